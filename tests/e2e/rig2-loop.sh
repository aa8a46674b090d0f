#!/usr/bin/env bash
# Runs the rig-2 tests (tests/e2e/test_rig2_nested.py) several times in a row and keeps one line
# per run in tests/out/rig2-loop/runs.tsv, each run's pytest output in runN.log and its L1 logs
# (with any .l1.hang sample) in outN/. A file tests/out/rig2-loop/STOP ends it before the next run.
#
#   tests/e2e/rig2-loop.sh FIRST LAST        e.g. BUSY="6 7 8 9 10" tests/e2e/rig2-loop.sh 1 10
#
# BUSY="N M ...": run numbers during which a busy loop 20 nice levels below the script (nice 10
# under `nice -n -10 tests/e2e/rig2-loop.sh`) keeps the other core busy.
# BVM_BOUNCEVM, BVM_RIG2_L1_SMP and the other rig-2 variables pass through to the tests.
set -uo pipefail
cd "$(dirname "$0")/../.."
[ $# -eq 2 ] || { echo "usage: tests/e2e/rig2-loop.sh FIRST LAST" >&2; exit 2; }
out=tests/out/rig2-loop
mkdir -p "$out"
for i in $(seq "$1" "$2"); do
    [ -f "$out/STOP" ] && break
    hog=""; busy=no
    if [[ " ${BUSY:-} " == *" $i "* ]]; then
        nice -n 20 sh -c 'while :; do :; done' & hog=$!; busy=yes
    fi
    rm -f tests/out/rig2_*.l1.hang
    start=$(date +%s); l0=$(cut -d' ' -f1 /proc/loadavg)
    python3 -m pytest -q -rA -p no:cacheprovider tests/e2e/test_rig2_nested.py > "$out/run$i.log" 2>&1
    rc=$?
    end=$(date +%s); l1=$(cut -d' ' -f1 /proc/loadavg)
    [ -n "$hog" ] && { kill "$hog"; wait "$hog" 2>/dev/null; }
    res=$(grep -E "^(PASSED|FAILED|SKIPPED|ERROR)" "$out/run$i.log" \
        | sed 's/ tests\/e2e\/test_rig2_nested.py::/ /' | awk '{print $2"="$1}' | tr '\n' ' ')
    mkdir -p "$out/out$i"
    cp -a tests/out/rig2_*.l1.log tests/out/rig2_*.l1.hang "$out/out$i/" 2>/dev/null
    printf '%s\tbusy=%s\t%s\t%ss\tload %s->%s\trc=%s\t%s\t%s\n' "$i" "$busy" \
        "$(date -u -d "@$start" +%H:%M)" "$((end - start))" "$l0" "$l1" "$rc" "$res" \
        "$(tail -n 1 "$out/run$i.log")" >> "$out/runs.tsv"
done
