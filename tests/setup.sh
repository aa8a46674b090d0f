#!/usr/bin/env bash
# Installs everything the tests and the main job need on a fresh Debian 12 machine (as root):
# Debian packages, pytest, the rig-1 QEMU (images/qemu.sh) and the guest images
# (images/build.sh, and the rig-2 L1 image, images/build-l1.sh). Idempotent; a second run takes
# seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
need=()
# dpdk-dev + librte-net-virtio23: dpdk-testpmd (DPDK virtio_user) drives the net presets of
# bouncevm-experiment in vmm/experiment/tests/experiment.rs (~1-2 min to install on a fresh machine).
for p in fio iperf3 busybox-static cpio iproute2 xz-utils zstd kmod socat qemu-utils dpdk-dev librte-net-virtio23; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
python3 -c 'import pytest' 2>/dev/null || python3 -m pip install -q -r tests/requirements.txt
bash images/qemu.sh >/dev/null
bash images/build.sh >/dev/null
bash images/build-l1.sh >/dev/null
