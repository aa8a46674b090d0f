#!/usr/bin/env bash
# Builds the rig-1 guest: a Debian cloud kernel (vmlinuz + virtio modules) and an uncompressed
# newc cpio initramfs holding busybox, fio, iperf3, their shared libraries, the modules and
# images/init. Debian packages only, nothing else is downloaded.
#
# Output (cached, rebuilt only when an input changes):
#   images/out/vmlinuz          the kernel
#   images/out/initramfs.cpio   the initramfs (uncompressed: decompressing under TCG is slow)
#   images/out/kernel-release   e.g. 6.12.118+deb12-cloud-amd64
#   images/out/stamp            sha256 of the inputs (this script, init, package versions)
#   images/out/build-info.txt   what went in
# The last lines printed are KEY=PATH pairs (VMLINUZ=..., INITRAMFS=...) for callers to parse.
#
# Environment:
#   BVM_KERNEL_PKG   force a kernel package (default: newest linux-image-6.12.*+deb12-cloud-amd64-unsigned,
#                    falling back to the newest 6.1 cloud kernel)
#   BVM_FORCE=1      rebuild even when the stamp matches
# Runs from any cwd; needs root the first time (apt-get) and for mknod.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="$HERE/out"
CACHE="$HERE/cache"
INIT_SRC="$HERE/init"
HOST_PKGS=(fio iperf3 busybox-static mawk cpio xz-utils kmod)

NAME=build.sh
# shellcheck source=images/lib.sh
source "$HERE/lib.sh"
install_host_pkgs "${HOST_PKGS[@]}"

# ---------------------------------------------------------------- kernel package choice
pick_kernel() {
    local names
    names="$(apt-cache pkgnames linux-image-6. 2>/dev/null || true)"
    local k
    k="$(printf '%s\n' "$names" | grep -E '^linux-image-6\.12\.[0-9]+\+deb12-cloud-amd64-unsigned$' | sort -V | tail -n1 || true)"
    if [ -z "$k" ]; then
        k="$(printf '%s\n' "$names" | grep -E '^linux-image-6\.1\.0-[0-9]+-cloud-amd64-unsigned$' | sort -V | tail -n1 || true)"
    fi
    printf '%s' "$k"
}
KPKG="${BVM_KERNEL_PKG:-$(pick_kernel)}"
if [ -z "$KPKG" ]; then
    apt_update_once
    KPKG="$(pick_kernel)"
fi
[ -n "$KPKG" ] || die "no cloud kernel package found (apt-get update?)"
KVER_PKG="$(apt-cache show --no-all-versions "$KPKG" 2>/dev/null | sed -n 's/^Version: //p' | head -n1)"
[ -n "$KVER_PKG" ] || die "apt-cache knows no version of $KPKG"

# ---------------------------------------------------------------- input hash / cache check
inputs() {
    sha256sum "$HERE/build.sh" "$HERE/lib.sh" "$INIT_SRC" "$HERE/swiotlb-capture.sh" | awk '{print $1}'
    echo "kernel $KPKG $KVER_PKG"
    for p in fio iperf3 busybox-static mawk libc6; do echo "$p $(pkg_ver "$p")"; done
}
[ -f "$INIT_SRC" ] || die "missing $INIT_SRC"
HASH="$(inputs | sha256sum | awk '{print $1}')"

print_outputs() {
    echo "VMLINUZ=$OUT/vmlinuz"
    echo "INITRAMFS=$OUT/initramfs.cpio"
    echo "KERNEL_RELEASE=$(cat "$OUT/kernel-release")"
}

if [ "${BVM_FORCE:-0}" != 1 ] && [ -f "$OUT/stamp" ] && [ "$(cat "$OUT/stamp")" = "$HASH" ] \
    && [ -s "$OUT/vmlinuz" ] && [ -s "$OUT/initramfs.cpio" ] && [ -s "$OUT/kernel-release" ]; then
    log "up to date ($KPKG $KVER_PKG)"
    print_outputs
    exit 0
fi

[ "$(id -u)" = 0 ] || die "building needs root (mknod /dev/console, apt-get download)"
mkdir -p "$OUT" "$CACHE"

# ---------------------------------------------------------------- kernel
fetch_kernel "$CACHE/kernel"

# ---------------------------------------------------------------- staging root
STAGE="$CACHE/rootfs"
rm -rf "$STAGE"
mkdir -p "$STAGE"/{usr/bin,usr/sbin,usr/lib,usr/lib64,proc,sys,dev,tmp,etc,root,mnt,run,var/tmp,lib/modules}
# merged-/usr layout, like the host, so library paths from ldd can be used as they are
ln -s usr/bin "$STAGE/bin"
ln -s usr/sbin "$STAGE/sbin"
rm -rf "$STAGE/lib"; ln -s usr/lib "$STAGE/lib"
ln -s usr/lib64 "$STAGE/lib64"
mkdir -p "$STAGE/usr/lib/modules"
chmod 1777 "$STAGE/tmp" "$STAGE/var/tmp"
mknod -m 600 "$STAGE/dev/console" c 5 1
mknod -m 666 "$STAGE/dev/null" c 1 3

# ---------------------------------------------------------------- modules
# Wanted drivers; on kernels where virtio_pci is a module (6.1) it is resolved too. Each module's
# depends= field pulls in what it needs; the load order (dependencies first) goes to
# /lib/modules/load-order, read by /init.
index_modules
# button and evdev: the ACPI power button as an input device for acpid (images/init).
for m in virtio_pci virtio_blk failover net_failover virtio_net button evdev; do resolve "$m"; done

stage_modules

# ---------------------------------------------------------------- busybox, fio, iperf3, libraries
stage_busybox

LDPATH=/usr/lib/x86_64-linux-gnu/ceph:/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu
# mawk: images/swiotlb-capture.sh converts a trace of ~100,000 maps with it, about three times
# faster than busybox's awk under TCG.
BINS=(/usr/bin/fio /usr/bin/iperf3 /usr/bin/mawk)
for b in "${BINS[@]}"; do
    [ -x "$b" ] || die "missing $b"
    rm -f "$STAGE$b"
    copy_file "$b"
done
LIBS="$(for b in "${BINS[@]}"; do LD_LIBRARY_PATH=$LDPATH ldd "$b"; done)"
if printf '%s\n' "$LIBS" | grep -q 'not found'; then
    printf '%s\n' "$LIBS" | grep 'not found' >&2
    die "unresolved libraries"
fi
nlibs=0
while IFS= read -r lib; do
    [ -n "$lib" ] || continue
    copy_file "$lib"
    nlibs=$((nlibs + 1))
done < <(printf '%s\n' "$LIBS" | awk '/=> \//{print $3} /^\t\//{print $1}' | sort -u)
log "copied $nlibs shared libraries"

# small /etc so tools that look up names do not complain
printf 'root:x:0:0:root:/root:/bin/sh\n' > "$STAGE/etc/passwd"
printf 'root:x:0:\n' > "$STAGE/etc/group"
printf '127.0.0.1 localhost\n' > "$STAGE/etc/hosts"
printf '%s\n' "$LDPATH" | tr ':' '\n' > "$STAGE/etc/ld.so.conf"
printf 'kernel=%s\nkernel_pkg=%s %s\nfio=%s\niperf3=%s\nbusybox=%s\n' "$KREL" "$KPKG" "$KVER_PKG" \
    "$(pkg_ver fio)" "$(pkg_ver iperf3)" "$(pkg_ver busybox-static)" > "$STAGE/etc/bvm-image"

install -m 0755 "$INIT_SRC" "$STAGE/init"
install -D -m 0755 "$HERE/swiotlb-capture.sh" "$STAGE/usr/lib/bvm/swiotlb-capture.sh"

# ---------------------------------------------------------------- outputs
(cd "$STAGE" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) > "$OUT/initramfs.cpio.tmp"
mv "$OUT/initramfs.cpio.tmp" "$OUT/initramfs.cpio"
cp "$KROOT/boot/vmlinuz-$KREL" "$OUT/vmlinuz.tmp" && mv "$OUT/vmlinuz.tmp" "$OUT/vmlinuz"
echo "$KREL" > "$OUT/kernel-release"
{
    echo "kernel_pkg=$KPKG $KVER_PKG"
    echo "kernel_release=$KREL"
    echo "modules=${ORDER[*]}"
    for p in fio iperf3 busybox-static mawk libc6; do echo "$p=$(pkg_ver "$p")"; done
    echo "libraries=$nlibs"
    echo "initramfs_bytes=$(stat -c %s "$OUT/initramfs.cpio")"
} > "$OUT/build-info.txt"
echo "$HASH" > "$OUT/stamp"
log "built $KREL, initramfs $(du -h "$OUT/initramfs.cpio" | cut -f1)"
print_outputs
