#!/usr/bin/env bash
# Builds the rig-2 L1 guest (ENVIRONMENT.md "Rig 2 -- nested KVM"): the Debian *generic* 6.12
# kernel (it ships kvm.ko / kvm-amd.ko) and a small uncompressed initramfs with busybox, the
# kvm / kvm-amd / irqbypass / ccp / 9p / 9pnet / 9pnet_virtio / netfs / tun modules (decompressed),
# iperf3 and socat with their libraries, kvm-hold (images/kvm-hold.c, static), images/l1-vmm and
# images/l1-init as /init. Debian packages only; the kernel package is extracted with dpkg-deb,
# never installed. Big payloads (L2 kernel, fio initramfs, VMM) are NOT in here: tests hand them
# to L1 over 9p.
#
# Output (cached, rebuilt only when an input changes):
#   images/out/l1-vmlinuz          the L1 kernel (bzImage)
#   images/out/l1-initramfs.cpio   the L1 initramfs (uncompressed newc)
#   images/out/l1-kernel-release   e.g. 6.12.118+deb12-amd64
#   images/out/l1-stamp            sha256 of the inputs
#   images/out/l1-build-info.txt   what went in
# Last lines printed: L1_VMLINUZ=..., L1_INITRAMFS=..., L1_KERNEL_RELEASE=...
#
# Environment: BVM_L1_KERNEL_PKG forces the kernel package (default: the newest
# linux-image-6.12.*+deb12-amd64-unsigned); BVM_FORCE=1 rebuilds. Needs root the first time.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="$HERE/out"
CACHE="$HERE/cache"
SRCS=("$HERE/build-l1.sh" "$HERE/lib.sh" "$HERE/l1-init" "$HERE/l1-vmm" "$HERE/kvm-hold.c")
HOST_PKGS=(iperf3 socat busybox-static cpio xz-utils kmod gcc libc6-dev)
MODULES=(irqbypass ccp kvm kvm_amd netfs 9pnet 9pnet_virtio 9p tun)

NAME=build-l1.sh
# shellcheck source=images/lib.sh
source "$HERE/lib.sh"
install_host_pkgs "${HOST_PKGS[@]}"

pick_kernel() {
    apt-cache pkgnames linux-image-6.12 2>/dev/null \
        | grep -E '^linux-image-6\.12\.[0-9]+\+deb12-amd64-unsigned$' | sort -V | tail -n1 || true
}
KPKG="${BVM_L1_KERNEL_PKG:-$(pick_kernel)}"
if [ -z "$KPKG" ]; then apt_update_once; KPKG="$(pick_kernel)"; fi
[ -n "$KPKG" ] || die "no linux-image-6.12.*+deb12-amd64-unsigned package (apt-get update?)"
KVER_PKG="$(apt-cache show --no-all-versions "$KPKG" 2>/dev/null | sed -n 's/^Version: //p' | head -n1)"
[ -n "$KVER_PKG" ] || die "apt-cache knows no version of $KPKG"

for f in "${SRCS[@]}"; do [ -f "$f" ] || die "missing $f"; done
inputs() {
    sha256sum "${SRCS[@]}" | awk '{print $1}'
    echo "kernel $KPKG $KVER_PKG"
    for p in iperf3 socat busybox-static libc6 gcc; do echo "$p $(pkg_ver "$p")"; done
}
HASH="$(inputs | sha256sum | awk '{print $1}')"

print_outputs() {
    echo "L1_VMLINUZ=$OUT/l1-vmlinuz"
    echo "L1_INITRAMFS=$OUT/l1-initramfs.cpio"
    echo "L1_KERNEL_RELEASE=$(cat "$OUT/l1-kernel-release")"
}
if [ "${BVM_FORCE:-0}" != 1 ] && [ -f "$OUT/l1-stamp" ] && [ "$(cat "$OUT/l1-stamp")" = "$HASH" ] \
    && [ -s "$OUT/l1-vmlinuz" ] && [ -s "$OUT/l1-initramfs.cpio" ] && [ -s "$OUT/l1-kernel-release" ]; then
    log "up to date ($KPKG $KVER_PKG)"
    print_outputs
    exit 0
fi
[ "$(id -u)" = 0 ] || die "building needs root (mknod, apt-get download)"
mkdir -p "$OUT" "$CACHE"

# ---------------------------------------------------------------- kernel
fetch_kernel "$CACHE/l1kernel"

# ---------------------------------------------------------------- staging root
STAGE="$CACHE/l1-rootfs"
rm -rf "$STAGE"
mkdir -p "$STAGE"/{usr/bin,usr/sbin,usr/lib,usr/lib64,proc,sys,dev,tmp,etc,root,mnt,run,host,var/tmp}
ln -s usr/bin "$STAGE/bin"; ln -s usr/sbin "$STAGE/sbin"
ln -s usr/lib "$STAGE/lib"; ln -s usr/lib64 "$STAGE/lib64"
mkdir -p "$STAGE/usr/lib/modules"
chmod 1777 "$STAGE/tmp" "$STAGE/var/tmp"
mknod -m 600 "$STAGE/dev/console" c 5 1
mknod -m 666 "$STAGE/dev/null" c 1 3

# ---------------------------------------------------------------- modules (dependencies first)
index_modules
for m in "${MODULES[@]}"; do resolve "$m"; done
# virtio_pci must be built in: 9pnet_virtio needs it before /init could load anything
is_builtin virtio_pci || resolve virtio_pci
stage_modules

# ---------------------------------------------------------------- busybox, iperf3, socat, kvm-hold
stage_busybox
BINS=(/usr/bin/iperf3 /usr/bin/socat)
for b in "${BINS[@]}"; do [ -x "$b" ] || die "missing $b"; rm -f "$STAGE$b"; copy_file "$b"; done
LIBS="$(for b in "${BINS[@]}"; do ldd "$b"; done)"
if printf '%s\n' "$LIBS" | grep -q 'not found'; then die "unresolved libraries: $(printf '%s\n' "$LIBS" | grep 'not found')"; fi
nlibs=0
while IFS= read -r lib; do
    [ -n "$lib" ] || continue
    copy_file "$lib"; nlibs=$((nlibs + 1))
done < <(printf '%s\n' "$LIBS" | awk '/=> \//{print $3} /^\t\//{print $1}' | sort -u)
gcc -static -Os -s -o "$STAGE/usr/bin/kvm-hold" "$HERE/kvm-hold.c"
install -m 0755 "$HERE/l1-vmm" "$STAGE/usr/bin/l1-vmm"
install -m 0755 "$HERE/l1-init" "$STAGE/init"

printf 'root:x:0:0:root:/root:/bin/sh\n' > "$STAGE/etc/passwd"
printf 'root:x:0:\n' > "$STAGE/etc/group"
printf '127.0.0.1 localhost\n' > "$STAGE/etc/hosts"
: > "$STAGE/etc/services"
printf 'kernel=%s\nkernel_pkg=%s %s\n' "$KREL" "$KPKG" "$KVER_PKG" > "$STAGE/etc/bvm-l1-image"

# ---------------------------------------------------------------- outputs
(cd "$STAGE" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) > "$OUT/l1-initramfs.cpio.tmp"
mv "$OUT/l1-initramfs.cpio.tmp" "$OUT/l1-initramfs.cpio"
cp "$KROOT/boot/vmlinuz-$KREL" "$OUT/l1-vmlinuz.tmp" && mv "$OUT/l1-vmlinuz.tmp" "$OUT/l1-vmlinuz"
echo "$KREL" > "$OUT/l1-kernel-release"
{
    echo "kernel_pkg=$KPKG $KVER_PKG"
    echo "kernel_release=$KREL"
    echo "modules=${ORDER[*]}"
    for p in iperf3 socat busybox-static libc6 gcc; do echo "$p=$(pkg_ver "$p")"; done
    echo "libraries=$nlibs"
    echo "initramfs_bytes=$(stat -c %s "$OUT/l1-initramfs.cpio")"
} > "$OUT/l1-build-info.txt"
echo "$HASH" > "$OUT/l1-stamp"
# the unpacked kernel tree is ~400 MB; only the .deb is kept
rm -rf "$KROOT"
log "built $KREL, initramfs $(du -h "$OUT/l1-initramfs.cpio" | cut -f1)"
print_outputs
