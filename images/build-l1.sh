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
PKGS=(iperf3 socat busybox-static libc6 gcc)
OUT_PREFIX=l1-
KEY_PREFIX=L1_

NAME=build-l1.sh
# shellcheck source=images/lib.sh
source "$HERE/lib.sh"
install_host_pkgs "${HOST_PKGS[@]}"

pick_kernel() {
    apt-cache pkgnames linux-image-6.12 2>/dev/null \
        | grep -E '^linux-image-6\.12\.[0-9]+\+deb12-amd64-unsigned$' | sort -V | tail -n1 || true
}
choose_kernel "${BVM_L1_KERNEL_PKG:-}" "no linux-image-6.12.*+deb12-amd64-unsigned package (apt-get update?)"

for f in "${SRCS[@]}"; do [ -f "$f" ] || die "missing $f"; done
HASH="$(inputs "${SRCS[@]}" | sha256sum | awk '{print $1}')"
exit_if_up_to_date
[ "$(id -u)" = 0 ] || die "building needs root (mknod, apt-get download)"
mkdir -p "$OUT" "$CACHE"

# ---------------------------------------------------------------- kernel
fetch_kernel "$CACHE/l1kernel"

# ---------------------------------------------------------------- staging root
STAGE="$CACHE/l1-rootfs"
new_stage host

# ---------------------------------------------------------------- modules (dependencies first)
index_modules
for m in "${MODULES[@]}"; do resolve "$m"; done
# virtio_pci must be built in: 9pnet_virtio needs it before /init could load anything
is_builtin virtio_pci || resolve virtio_pci
stage_modules

# ---------------------------------------------------------------- busybox, iperf3, socat, kvm-hold
stage_busybox
stage_binaries /usr/bin/iperf3 /usr/bin/socat
gcc -static -Os -s -o "$STAGE/usr/bin/kvm-hold" "$HERE/kvm-hold.c"
install -m 0755 "$HERE/l1-vmm" "$STAGE/usr/bin/l1-vmm"
install -m 0755 "$HERE/l1-init" "$STAGE/init"

stage_etc
: > "$STAGE/etc/services"
printf 'kernel=%s\nkernel_pkg=%s %s\n' "$KREL" "$KPKG" "$KVER_PKG" > "$STAGE/etc/bvm-l1-image"

# ---------------------------------------------------------------- outputs
write_outputs
# the unpacked kernel tree is ~400 MB; only the .deb is kept
rm -rf "$KROOT"
print_outputs
