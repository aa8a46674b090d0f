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
PKGS=(fio iperf3 busybox-static mawk libc6)
OUT_PREFIX=
KEY_PREFIX=

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
choose_kernel "${BVM_KERNEL_PKG:-}" "no cloud kernel package found (apt-get update?)"

# ---------------------------------------------------------------- input hash / cache check
[ -f "$INIT_SRC" ] || die "missing $INIT_SRC"
HASH="$(inputs "$HERE/build.sh" "$HERE/lib.sh" "$INIT_SRC" "$HERE/swiotlb-capture.sh" | sha256sum | awk '{print $1}')"
exit_if_up_to_date

[ "$(id -u)" = 0 ] || die "building needs root (mknod /dev/console, apt-get download)"
mkdir -p "$OUT" "$CACHE"

# ---------------------------------------------------------------- kernel
fetch_kernel "$CACHE/kernel"

# ---------------------------------------------------------------- staging root
STAGE="$CACHE/rootfs"
new_stage

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
stage_binaries /usr/bin/fio /usr/bin/iperf3 /usr/bin/mawk

stage_etc
printf '%s\n' "$LDPATH" | tr ':' '\n' > "$STAGE/etc/ld.so.conf"
printf 'kernel=%s\nkernel_pkg=%s %s\nfio=%s\niperf3=%s\nbusybox=%s\n' "$KREL" "$KPKG" "$KVER_PKG" \
    "$(pkg_ver fio)" "$(pkg_ver iperf3)" "$(pkg_ver busybox-static)" > "$STAGE/etc/bvm-image"

install -m 0755 "$INIT_SRC" "$STAGE/init"
install -D -m 0755 "$HERE/swiotlb-capture.sh" "$STAGE/usr/lib/bvm/swiotlb-capture.sh"

# ---------------------------------------------------------------- outputs
write_outputs
print_outputs
