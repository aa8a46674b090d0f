#!/usr/bin/env bash
# Finds (or provides) the rig-1 QEMU: prints QEMU=PATH and QSD=PATH (qemu-storage-daemon).
#
# 1. qemu-system-x86_64 on PATH (or $BVM_QEMU) is used as it is.
# 2. Otherwise, if `apt-get install qemu-system-x86` would not remove anything, it is installed.
# 3. Otherwise (the usual case on these machines: qemu-utils 10 from bookworm-backports is
#    installed and Breaks Debian 12's qemu-system-common 7.2, so apt would remove it), Debian 12's
#    qemu-system-x86 and qemu-system-common 7.2 are fetched with `apt-get download`, extracted
#    with `dpkg-deb -x` under images/cache/qemu/ (nothing installed from them), their library
#    dependencies installed with apt, and a wrapper images/out/qemu-system-x86_64 written that
#    sets QEMU_MODULE_DIR (TCG is a loadable module in Debian's build) and the firmware paths.
#
# qemu-storage-daemon: $BVM_QSD, else the one on PATH (qemu-utils >= 8 or qemu-system-common 7.2),
# else the extracted 7.2 one.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="$HERE/out"
QC="$HERE/cache/qemu"
log() { echo "qemu.sh: $*" >&2; }
die() { echo "qemu.sh: error: $*" >&2; exit 1; }

find_qsd() {
    if [ -n "${BVM_QSD:-}" ]; then echo "$BVM_QSD"; return; fi
    if command -v qemu-storage-daemon >/dev/null; then command -v qemu-storage-daemon; return; fi
    if [ -x "$QC/root/usr/bin/qemu-storage-daemon" ]; then echo "$OUT/qemu-storage-daemon"; return; fi
    echo ""
}

emit() { echo "QEMU=$1"; echo "QSD=$(find_qsd)"; }

if [ -n "${BVM_QEMU:-}" ]; then emit "$BVM_QEMU"; exit 0; fi
if command -v qemu-system-x86_64 >/dev/null; then emit "$(command -v qemu-system-x86_64)"; exit 0; fi
if [ -x "$OUT/qemu-system-x86_64" ] && "$OUT/qemu-system-x86_64" -version >/dev/null 2>&1; then
    emit "$OUT/qemu-system-x86_64"; exit 0
fi

[ "$(id -u)" = 0 ] || die "no qemu-system-x86_64 and not root"
export DEBIAN_FRONTEND=noninteractive
apt-cache show qemu-system-x86 >/dev/null 2>&1 || apt-get update -qq >&2
if ! apt-get install -s -y --no-install-recommends qemu-system-x86 2>/dev/null | grep -q '^Remv '; then
    log "installing qemu-system-x86"
    apt-get install -y -qq --no-install-recommends qemu-system-x86 >&2
    emit "$(command -v qemu-system-x86_64)"; exit 0
fi

log "apt would remove packages to install qemu-system-x86; extracting it under $QC instead"
mkdir -p "$QC/debs" "$OUT"
(cd "$QC/debs" && rm -f ./*.deb && apt-get -qq -o APT::Sandbox::User=root download qemu-system-x86 qemu-system-common >&2)
rm -rf "$QC/root"
deps=()
for d in "$QC"/debs/*.deb; do
    dpkg-deb -x "$d" "$QC/root"
    # Depends: "a (>= 1), b | c, ..." -> first alternative of each, without qemu-* packages
    while IFS= read -r p; do
        case "$p" in qemu-*|"") ;; *) deps+=("$p") ;; esac
    done < <(dpkg-deb -f "$d" Depends | tr ',' '\n' | sed 's/|.*//; s/(.*)//; s/[[:space:]]//g')
done
deps+=(seabios ipxe-qemu qemu-system-data)
# install only what is missing: naming an installed package would upgrade it
missing=()
for p in $(printf '%s\n' "${deps[@]}" | sort -u); do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    log "installing runtime libraries: ${missing[*]}"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

cat > "$OUT/qemu-system-x86_64" <<EOF
#!/bin/sh
# written by images/qemu.sh: Debian 12 QEMU 7.2 extracted under images/cache/qemu
export QEMU_MODULE_DIR="$QC/root/usr/lib/x86_64-linux-gnu/qemu"
exec "$QC/root/usr/bin/qemu-system-x86_64" -L /usr/share/seabios -L /usr/share/qemu -L /usr/lib/ipxe/qemu "\$@"
EOF
cat > "$OUT/qemu-storage-daemon" <<EOF
#!/bin/sh
# written by images/qemu.sh: Debian 12 qemu-storage-daemon 7.2 extracted under images/cache/qemu
export QEMU_MODULE_DIR="$QC/root/usr/lib/x86_64-linux-gnu/qemu"
exec "$QC/root/usr/bin/qemu-storage-daemon" "\$@"
EOF
chmod +x "$OUT/qemu-system-x86_64" "$OUT/qemu-storage-daemon"
"$OUT/qemu-system-x86_64" -version >&2 || die "extracted QEMU does not run"
emit "$OUT/qemu-system-x86_64"
