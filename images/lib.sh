# Shared by build.sh and build-l1.sh (sourced, not run). The caller sets NAME (for messages),
# STAGE (the staging root, for the stage_* functions), KPKG and KVER_PKG (for fetch_kernel).

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
