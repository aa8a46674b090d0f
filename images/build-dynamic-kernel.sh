#!/usr/bin/env bash
# Builds a rig-1 guest kernel with CONFIG_SWIOTLB_DYNAMIC=y and CONFIG_DMA_MAP_BENCHMARK=y (both
# off in Debian's prebuilt kernels) from Debian's linux-source-6.12 package: the same 6.12 as the
# stock cloud kernel, with Debian's patches. Debian packages only, nothing else is downloaded.
#
# Configuration: `make tinyconfig` with images/dynamic-kernel.config merged over it (virtio-pci,
# virtio-blk and virtio-net built in, kprobes, kretprobes, ftrace, debugfs, KALLSYMS_ALL); every
# option of the fragment is checked in the final .config. The kernel boots with the rig-1
# initramfs of images/build.sh (images/init skips that image's modules on another kernel).
#
# Output (cached, rebuilt only when an input changes):
#   images/out/vmlinuz-dynamic          the kernel (bzImage)
#   images/out/dynamic-kernel-release   e.g. 6.12.118-bvm-dynamic
#   images/out/dynamic-config           its .config
#   images/out/dynamic-System.map       its symbols
#   images/out/dynamic-visible-at       SYMBOL+OFFSET where a pool added by the growth worker has
#                                       just become visible to mappers: the instruction of
#                                       swiotlb_dyn_alloc that jumps to _raw_spin_unlock, right
#                                       after add_mem_pool's list_add_rcu and nslabs update
#                                       (pool lock held); images/swiotlb-capture.sh probes it
#                                       (bvm.visible_at=)
#   images/out/dynamic-stamp            sha256 of the inputs (this script, lib.sh, the fragment,
#                                       the source package version, gcc's version)
#   images/out/dynamic-build-info.txt   what went in, and how long the last make ran (make_seconds:
#                                       a clean build, or what a change rebuilt)
# The unpacked source and the object tree (vmlinux included, for objdump) stay under
# images/cache/dynkernel/. The last lines printed are KEY=VALUE pairs (DYN_VMLINUZ=...).
#
# Environment:
#   BVM_DYN_SRC_PKG   the source package (default linux-source-6.12)
#   BVM_DYN_JOBS      make -j (default 2); the build runs under nice -n 10
#   BVM_FORCE=1       rebuild even when the stamp matches
# Concurrent runs are serialised (flock on images/cache/dynkernel.lock).
# Runs from any cwd; needs root the first time (apt-get).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="$HERE/out"
CACHE="$HERE/cache"
FRAG="$HERE/dynamic-kernel.config"
DIR="$CACHE/dynkernel"
HOST_PKGS=(build-essential bc flex bison libelf-dev xz-utils)

NAME=build-dynamic-kernel.sh
# shellcheck source=images/lib.sh
source "$HERE/lib.sh"
# One build at a time: a second caller (the capture test while tests/run's background build
# still runs) waits here, then finds the kernel up to date.
mkdir -p "$CACHE"
exec 9>"$CACHE/dynkernel.lock"
flock 9
install_host_pkgs "${HOST_PKGS[@]}"

SRC_PKG="${BVM_DYN_SRC_PKG:-linux-source-6.12}"
SRC_VER="$(apt-cache show --no-all-versions "$SRC_PKG" 2>/dev/null | sed -n 's/^Version: //p' | head -n1)"
if [ -z "$SRC_VER" ]; then
    apt_update_once
    SRC_VER="$(apt-cache show --no-all-versions "$SRC_PKG" 2>/dev/null | sed -n 's/^Version: //p' | head -n1)"
fi
[ -n "$SRC_VER" ] || die "apt-cache knows no version of $SRC_PKG"
[ -f "$FRAG" ] || die "missing $FRAG"

inputs() {
    sha256sum "$HERE/build-dynamic-kernel.sh" "$HERE/lib.sh" "$FRAG" | awk '{print $1}'
    echo "source $SRC_PKG $SRC_VER"
    echo "gcc $(pkg_ver gcc-12 2>/dev/null || gcc -dumpfullversion)"
}
HASH="$(inputs | sha256sum | awk '{print $1}')"

print_outputs() {
    echo "DYN_VMLINUZ=$OUT/vmlinuz-dynamic"
    echo "DYN_KERNEL_RELEASE=$(cat "$OUT/dynamic-kernel-release")"
    echo "DYN_CONFIG=$OUT/dynamic-config"
    echo "DYN_VMLINUX=$DIR/build/vmlinux"
    echo "DYN_VISIBLE_AT=$(cat "$OUT/dynamic-visible-at")"
}

if [ "${BVM_FORCE:-0}" != 1 ] && [ -f "$OUT/dynamic-stamp" ] && [ "$(cat "$OUT/dynamic-stamp")" = "$HASH" ] \
    && [ -s "$OUT/vmlinuz-dynamic" ] && [ -s "$OUT/dynamic-kernel-release" ] \
    && [ -s "$OUT/dynamic-visible-at" ]; then
    log "up to date ($SRC_PKG $SRC_VER)"
    print_outputs
    exit 0
fi

[ "$(id -u)" = 0 ] || die "building needs root (apt-get download)"
mkdir -p "$OUT" "$DIR"

# ---------------------------------------------------------------- source
# Subtrees this configuration never builds (documentation, sound, other architectures, GPU,
# Ethernet, wireless, media, staging and InfiniBand drivers, tool test suites): only their
# Kconfig, Makefile and Kbuild files are unpacked, since Kconfig sources them and make reads
# them. That leaves about 0.6 GB of the 1.7 GB tree.
PRUNE='Documentation|sound|tools/testing|tools/perf|arch/[^x/][^/]*|arch/xtensa'
PRUNE="$PRUNE|drivers/(gpu/drm/(amd|i915|xe|nouveau)|net/(ethernet|wireless)|media|staging|infiniband)"
# What the unpacked tree, the object tree and the package need together, with a margin.
NEED_MB=1500
SRC="$DIR/$SRC_PKG"
if [ "$(cat "$SRC/.bvm-source-version" 2>/dev/null || true)" != "$SRC_VER" ]; then
    rm -rf "$SRC" "$DIR/build"
    free_mb="$(df -Pm "$DIR" | awk 'NR == 2 {print $4}')"
    [ "$free_mb" -ge "$NEED_MB" ] \
        || die "needs about $NEED_MB MB free in $DIR to unpack and build the kernel; $free_mb MB are free"
    download_deb "$DIR" "$SRC_PKG" "$SRC_VER"
    log "unpacking $SRC_PKG $SRC_VER (without the subtrees this configuration never builds)"
    tarball() { dpkg-deb --fsys-tarfile "$DEB" | tar -xO "./usr/src/$SRC_PKG.tar.xz"; }
    tarball | tar -tJ \
        | awk -v top="$SRC_PKG/" -v prune="^($PRUNE)/" '{
              rel = substr($0, length(top) + 1)
              n = split(rel, part, "/"); base = part[n]
              if (rel !~ prune || base == "" || base ~ /^(Kconfig|Makefile|Kbuild)/) print
          }' > "$DIR/unpack.list"
    (cd "$DIR" && tarball | nice -n 10 tar -xJ --no-recursion -T unpack.list)
    rm -f "$DIR/unpack.list" "$DEB"
    [ -f "$SRC/Makefile" ] || die "unexpected layout in $SRC_PKG $SRC_VER (no $SRC/Makefile)"
    echo "$SRC_VER" > "$SRC/.bvm-source-version"
fi

# ---------------------------------------------------------------- configuration
BUILD="$DIR/build"
mkdir -p "$BUILD"
JOBS="${BVM_DYN_JOBS:-2}"
# Reproducible identity strings: the same inputs give the same image.
export KBUILD_BUILD_USER=bvm KBUILD_BUILD_HOST=bvm \
    KBUILD_BUILD_TIMESTAMP="$SRC_VER $SRC_PKG"
kmake() { nice -n 10 make -C "$SRC" O="$BUILD" ARCH=x86_64 "$@"; }

kmake -s tinyconfig >&2
"$SRC/scripts/kconfig/merge_config.sh" -m -O "$BUILD" "$BUILD/.config" "$FRAG" >/dev/null
kmake -s olddefconfig >&2
# Every line of the fragment must have survived olddefconfig.
bad=0
while IFS= read -r line; do
    case "$line" in
        CONFIG_*=*) want="$line" ;;
        "# CONFIG_"*" is not set") want="$line" ;;
        *) continue ;;
    esac
    opt="$(printf '%s' "$want" | sed -E 's/^# (CONFIG_[A-Za-z0-9_]+) is not set$/\1/; s/^(CONFIG_[A-Za-z0-9_]+)=.*/\1/')"
    got="$(grep -E "^(# )?$opt[= ]" "$BUILD/.config" || echo "# $opt is not set")"
    if [ "$got" != "$want" ]; then
        log "config: wanted '$want', got '$got'"
        bad=1
    fi
done < "$FRAG"
[ "$bad" = 0 ] || die "the configuration differs from $FRAG (dependencies missing?)"

# ---------------------------------------------------------------- build
t0="$(date +%s)"
log "building (make -j$JOBS under nice -n 10; log in $BUILD/build.log)"
if ! kmake -j"$JOBS" bzImage > "$BUILD/build.log" 2>&1; then
    tail -n 40 "$BUILD/build.log" >&2
    die "kernel build failed (see $BUILD/build.log)"
fi
t1="$(date +%s)"
KREL="$(kmake -s kernelrelease)"

# add_mem_pool is inlined into swiotlb_dyn_alloc: find the tail jump to _raw_spin_unlock that
# ends it (the pool is on mem->pools and counted in mem->nslabs, the lock still held).
dis="$(objdump -d --no-show-raw-insn --disassemble=swiotlb_dyn_alloc "$BUILD/vmlinux")"
fstart="$(printf '%s\n' "$dis" | sed -n 's/^\([0-9a-f]*\) <swiotlb_dyn_alloc>:$/\1/p' | head -n1)"
jaddr="$(printf '%s\n' "$dis" | sed -n 's/^ *\([0-9a-f]*\):.*<_raw_spin_unlock>$/\1/p' | head -n1)"
visible_at=""
[ -n "$fstart" ] && [ -n "$jaddr" ] && visible_at="swiotlb_dyn_alloc+0x$(printf '%x' $((0x$jaddr - 0x$fstart)))"
[ -n "$visible_at" ] || die "no _raw_spin_unlock in swiotlb_dyn_alloc (add_mem_pool not inlined?)"

cp "$BUILD/arch/x86/boot/bzImage" "$OUT/vmlinuz-dynamic.tmp" && mv "$OUT/vmlinuz-dynamic.tmp" "$OUT/vmlinuz-dynamic"
cp "$BUILD/.config" "$OUT/dynamic-config"
cp "$BUILD/System.map" "$OUT/dynamic-System.map"
echo "$KREL" > "$OUT/dynamic-kernel-release"
echo "$visible_at" > "$OUT/dynamic-visible-at"
{
    echo "source_pkg=$SRC_PKG $SRC_VER"
    echo "kernel_release=$KREL"
    echo "config=tinyconfig + $(basename "$FRAG") (sha256 $(sha256sum "$FRAG" | cut -c1-16))"
    echo "gcc=$(gcc -dumpfullversion)"
    echo "jobs=$JOBS"
    echo "visible_at=$visible_at"
    echo "make_seconds=$((t1 - t0))"
    echo "vmlinuz_bytes=$(stat -c %s "$OUT/vmlinuz-dynamic")"
} > "$OUT/dynamic-build-info.txt"
echo "$HASH" > "$OUT/dynamic-stamp"
log "built $KREL in $((t1 - t0)) s"
print_outputs
