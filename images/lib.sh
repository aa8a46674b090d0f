# Shared by build.sh and build-l1.sh (sourced, not run). The caller sets NAME (for messages),
# OUT (the output folder), OUT_PREFIX (the prefix of the output files' names) and KEY_PREFIX
# (of the KEY=PATH lines printed), PKGS (the host packages whose versions go into the stamp and
# the build info), STAGE (the staging root, for new_stage and the stage_* functions) and, for
# pick_kernel, a function printing the newest wanted kernel package.

log() { echo "$NAME: $*" >&2; }
die() { echo "$NAME: error: $*" >&2; exit 1; }

have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q '^install ok installed$'; }
pkg_ver() { dpkg-query -W -f='${Version}' "$1"; }

APT_UPDATED=0
apt_update_once() {
    if [ "$APT_UPDATED" = 0 ]; then
        log "apt-get update"
        apt-get update -qq >&2
        APT_UPDATED=1
    fi
}

# Installs the host packages given as arguments that are missing (root only).
install_host_pkgs() {
    local missing=() p
    for p in "$@"; do have_pkg "$p" || missing+=("$p"); done
    if [ "${#missing[@]}" -gt 0 ]; then
        [ "$(id -u)" = 0 ] || die "missing packages ${missing[*]} and not root"
        apt_update_once
        log "installing ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
    fi
}

# Sets DEB to the .deb of package $2 version $3 in the folder $1, downloading it with apt-get
# unless that version is already there (the folder is the cache; other versions of the package
# are removed from it).
download_deb() {
    local dir="$1" pkg="$2" ver="$3"
    mkdir -p "$dir"
    DEB="$(ls "$dir"/"${pkg}"_*.deb 2>/dev/null | head -n1 || true)"
    if [ -z "$DEB" ] || [ "$(dpkg-deb -f "$DEB" Version)" != "$ver" ]; then
        rm -f "$dir"/"${pkg}"_*.deb
        log "downloading $pkg $ver"
        (cd "$dir" && apt-get -qq -o APT::Sandbox::User=root download "$pkg=$ver" >&2) \
            || { apt_update_once; (cd "$dir" && apt-get -qq -o APT::Sandbox::User=root download "$pkg=$ver" >&2); }
        DEB="$(ls "$dir"/"${pkg}"_*.deb | head -n1)"
    fi
}

# Sets KPKG to $1 when it is not empty, else to what pick_kernel prints (after an apt-get
# update when it prints nothing at first), and KVER_PKG to the package's version; dies saying
# $2 when there is no package.
choose_kernel() {
    KPKG="${1:-$(pick_kernel)}"
    if [ -z "$KPKG" ]; then
        apt_update_once
        KPKG="$(pick_kernel)"
    fi
    [ -n "$KPKG" ] || die "$2"
    KVER_PKG="$(apt-cache show --no-all-versions "$KPKG" 2>/dev/null | sed -n 's/^Version: //p' | head -n1)"
    [ -n "$KVER_PKG" ] || die "apt-cache knows no version of $KPKG"
}

# What the stamp is the hash of: the sha256 of each file given, the kernel package and the
# versions of PKGS.
inputs() {
    local p
    sha256sum "$@" | awk '{print $1}'
    echo "kernel $KPKG $KVER_PKG"
    for p in "${PKGS[@]}"; do echo "$p $(pkg_ver "$p")"; done
}

# The last lines on stdout, parsed by the tests (tests/e2e/rig1.py build_images).
print_outputs() {
    echo "${KEY_PREFIX}VMLINUZ=$OUT/${OUT_PREFIX}vmlinuz"
    echo "${KEY_PREFIX}INITRAMFS=$OUT/${OUT_PREFIX}initramfs.cpio"
    echo "${KEY_PREFIX}KERNEL_RELEASE=$(cat "$OUT/${OUT_PREFIX}kernel-release")"
}

# Prints the outputs and exits when they exist and their stamp holds $HASH (the inputs have not
# changed), unless BVM_FORCE=1.
exit_if_up_to_date() {
    local o="$OUT/$OUT_PREFIX"
    if [ "${BVM_FORCE:-0}" != 1 ] && [ -f "${o}stamp" ] && [ "$(cat "${o}stamp")" = "$HASH" ] \
        && [ -s "${o}vmlinuz" ] && [ -s "${o}initramfs.cpio" ] && [ -s "${o}kernel-release" ]; then
        log "up to date ($KPKG $KVER_PKG)"
        print_outputs
        exit 0
    fi
}

# Downloads $KPKG=$KVER_PKG into the folder $1 (kept there as a cache) and extracts it with
# dpkg-deb (never installed). Sets KROOT, KREL and MODDIR.
fetch_kernel() {
    local kdir="$1" deb
    download_deb "$kdir" "$KPKG" "$KVER_PKG"
    deb="$DEB"
    KROOT="$kdir/root"
    rm -rf "$KROOT"
    dpkg-deb -x "$deb" "$KROOT"
    KREL="$(ls "$KROOT/lib/modules" | head -n1)"
    [ -n "$KREL" ] && [ -f "$KROOT/boot/vmlinuz-$KREL" ] || die "unexpected layout in $deb"
    MODDIR="$KROOT/lib/modules/$KREL"
}

# Creates the staging root $STAGE afresh: a merged-/usr layout like the host's (so library paths
# from ldd can be used as they are), world-writable tmp folders, /dev/console, /dev/null,
# usr/lib/modules, and the further folders given as arguments.
new_stage() {
    local d
    rm -rf "$STAGE"
    mkdir -p "$STAGE"/{usr/bin,usr/sbin,usr/lib,usr/lib64,proc,sys,dev,tmp,etc,root,mnt,run,var/tmp}
    for d in "$@"; do mkdir -p "$STAGE/$d"; done
    ln -s usr/bin "$STAGE/bin"
    ln -s usr/sbin "$STAGE/sbin"
    ln -s usr/lib "$STAGE/lib"
    ln -s usr/lib64 "$STAGE/lib64"
    mkdir -p "$STAGE/usr/lib/modules"
    chmod 1777 "$STAGE/tmp" "$STAGE/var/tmp"
    mknod -m 600 "$STAGE/dev/console" c 5 1
    mknod -m 666 "$STAGE/dev/null" c 1 3
}

# Module files of the extracted kernel by module name (dashes as underscores).
declare -A MODFILE=()
index_modules() {
    local f b
    while IFS= read -r f; do
        b="$(basename "$f")"; b="${b%.xz}"; b="${b%.zst}"; b="${b%.ko}"; b="${b//-/_}"
        MODFILE[$b]="$f"
    done < <(find "$MODDIR/kernel" -name '*.ko' -o -name '*.ko.xz' -o -name '*.ko.zst')
}

is_builtin() {
    grep -qE "/${1//_/[_-]}\.ko\$" "$MODDIR/modules.builtin" 2>/dev/null
}

# Appends module $1 to ORDER after everything its depends= field names (built-ins skipped).
ORDER=()
declare -A SEEN=()
resolve() {
    local m="${1//-/_}"
    [ -n "${SEEN[$m]:-}" ] && return 0
    SEEN[$m]=1
    local f="${MODFILE[$m]:-}"
    if [ -z "$f" ]; then
        is_builtin "$m" && return 0
        die "module $m neither a module nor built in ($KREL)"
    fi
    local deps d
    deps="$(modinfo -F depends "$f" | tr ',' ' ')"
    for d in $deps; do resolve "$d"; done
    ORDER+=("$m")
}

# Copies the modules of ORDER, decompressed, to $STAGE/usr/lib/modules with their load order.
stage_modules() {
    local dst="$STAGE/usr/lib/modules" m f
    : > "$dst/load-order"
    for m in "${ORDER[@]}"; do
        f="${MODFILE[$m]}"
        case "$f" in
            *.ko.xz) xz -dc "$f" > "$dst/$m.ko" ;;
            *.ko.zst) zstd -qdc "$f" > "$dst/$m.ko" ;;
            *) cp "$f" "$dst/$m.ko" ;;
        esac
        echo "$m" >> "$dst/load-order"
    done
    log "modules: ${ORDER[*]}"
}

# The host's static busybox as $STAGE/usr/bin/busybox, with a link for each applet under
# usr/bin or usr/sbin.
stage_busybox() {
    local bb=/bin/busybox a d n
    [ -x "$bb" ] || die "no $bb (busybox-static)"
    if command -v file >/dev/null; then file -L "$bb" | grep -q "statically linked" || log "warning: $bb may not be static"; fi
    cp "$bb" "$STAGE/usr/bin/busybox"
    "$bb" --list-full | while IFS= read -r a; do
        # paths like usr/bin/awk, sbin/ip, linuxrc; put everything under usr/bin or usr/sbin
        case "$a" in
            */*) d="$(dirname "$a")"; n="$(basename "$a")" ;;
            *) continue ;;
        esac
        case "$d" in bin|usr/bin) d=usr/bin ;; sbin|usr/sbin) d=usr/sbin ;; *) continue ;; esac
        [ -e "$STAGE/$d/$n" ] || ln -s /usr/bin/busybox "$STAGE/$d/$n"
    done
}

# Copies a host file (resolving symlinks) to the same path in the staging root.
copy_file() {
    local src="$1" dst="$STAGE$1"
    mkdir -p "$(dirname "$dst")"
    [ -e "$dst" ] || cp -L "$src" "$dst"
}

# Copies the host binaries given as arguments to the staging root with the shared libraries ldd
# finds for them (with LD_LIBRARY_PATH=$LDPATH when LDPATH is set); sets NLIBS to how many.
stage_binaries() {
    local b libs lib
    for b in "$@"; do
        [ -x "$b" ] || die "missing $b"
        rm -f "$STAGE$b"
        copy_file "$b"
    done
    libs="$(for b in "$@"; do LD_LIBRARY_PATH="${LDPATH:-${LD_LIBRARY_PATH:-}}" ldd "$b"; done)"
    if printf '%s\n' "$libs" | grep -q 'not found'; then
        die "unresolved libraries: $(printf '%s\n' "$libs" | grep 'not found')"
    fi
    NLIBS=0
    while IFS= read -r lib; do
        [ -n "$lib" ] || continue
        copy_file "$lib"
        NLIBS=$((NLIBS + 1))
    done < <(printf '%s\n' "$libs" | awk '/=> \//{print $3} /^\t\//{print $1}' | sort -u)
    log "copied $NLIBS shared libraries"
}

# A small /etc so tools that look up names do not complain.
stage_etc() {
    printf 'root:x:0:0:root:/root:/bin/sh\n' > "$STAGE/etc/passwd"
    printf 'root:x:0:\n' > "$STAGE/etc/group"
    printf '127.0.0.1 localhost\n' > "$STAGE/etc/hosts"
}

# Writes the outputs: the staging root as an uncompressed newc cpio, the kernel, its release,
# the build info (kernel, modules, PKGS' versions, NLIBS, initramfs size) and last the stamp.
write_outputs() {
    local o="$OUT/$OUT_PREFIX" p
    (cd "$STAGE" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) > "${o}initramfs.cpio.tmp"
    mv "${o}initramfs.cpio.tmp" "${o}initramfs.cpio"
    cp "$KROOT/boot/vmlinuz-$KREL" "${o}vmlinuz.tmp" && mv "${o}vmlinuz.tmp" "${o}vmlinuz"
    echo "$KREL" > "${o}kernel-release"
    {
        echo "kernel_pkg=$KPKG $KVER_PKG"
        echo "kernel_release=$KREL"
        echo "modules=${ORDER[*]}"
        for p in "${PKGS[@]}"; do echo "$p=$(pkg_ver "$p")"; done
        echo "libraries=$NLIBS"
        echo "initramfs_bytes=$(stat -c %s "${o}initramfs.cpio")"
    } > "${o}build-info.txt"
    echo "$HASH" > "${o}stamp"
    log "built $KREL, initramfs $(du -h "${o}initramfs.cpio" | cut -f1)"
}
