#!/bin/sh
# Guest side of the swiotlb trace capture (busybox sh; run by /init for bvm.test=swiotlb-capture,
# installed in the initramfs as /usr/lib/bvm/swiotlb-capture.sh by images/build.sh).
#
# Inside a guest booted with swiotlb=<slots>,<areas>,force it records every swiotlb map and
# unmap of the running kernel with kprobes -- swiotlb_tbl_map_single (arguments, return value
# and every area's used count and rolling index read at the return), __swiotlb_tbl_unmap_single
# (arguments) -- while fio runs on a disk, converts the tracefs text to the kernel-trace format
# that bounce-replay reads (swiotlb-kernel-trace/1, see bounce/README.md), gzips it and writes
# it to the raw disk whose virtio serial is bvm.trace_serial (default "bvmtrace"):
#
#   bytes 0..511   "BVMTRACE1 <gzip bytes> <sha256 of the gzip>\n", zero padded
#   bytes 4096..   the gzip'd JSON lines
#
# The trace disk must not bounce (no ACCESS_PLATFORM: virtio then bypasses the DMA API), and
# tracing is off before it is written, so the capture never records its own output.
#
# Parameters (kernel command line): bvm.dev=/dev/vda (the disk fio runs on), bvm.trace_serial,
# bvm.runtime=3, bvm.size=32M, bvm.iodepth=16, bvm.bsrange=512-256k, bvm.rw=randrw.
# Prints BVM-INFO/BVM-LOG lines and one "BVM-RESULT test=swiotlb-capture ..." line.
#
# Layout assumed for the area state (Linux 6.6-6.12 without CONFIG_SWIOTLB_DYNAMIC:
# io_tlb_default_mem.defpool is struct io_tlb_pool {start @0, end @8, vaddr @16, nslabs @24,
# late_alloc @32, nareas @36, area_nslabs @40, areas @48}, struct io_tlb_area {used @0,
# index @8}, 16 bytes): checked at run time -- the nslabs and nareas read at those offsets must
# equal debugfs io_tlb_nslabs and the kernel's "area num" message, else the capture fails.

T=swiotlb-capture
for w in $(cat /proc/cmdline); do
    case "$w" in
        bvm.*=*) k="${w%%=*}"; k="${k#bvm.}"; v="${w#*=}"
            case "$k" in *[!a-z0-9_]*) ;; *) eval "C_$k=\$v" ;; esac ;;
    esac
done
dev="${C_dev:-/dev/vda}"
serial="${C_trace_serial:-bvmtrace}"
fail() { echo "BVM-RESULT test=$T status=fail reason=$1 ${2:-}"; exit 0; }

TR=/sys/kernel/tracing
[ -d "$TR/events" ] || mount -t tracefs nodev "$TR" 2>/dev/null
[ -w "$TR/kprobe_events" ] || fail no-tracefs
D=/sys/kernel/debug/swiotlb
[ -r "$D/io_tlb_nslabs" ] || fail no-swiotlb "hint=boot-with-swiotlb=N,A,force"
nslabs="$(cat "$D/io_tlb_nslabs")"
nareas="$(dmesg | sed -n 's/.*software IO TLB: area num \([0-9]*\).*/\1/p' | head -n1)"
[ -n "$nareas" ] || nareas=1
# "mapped [mem START-LAST]": the pool's physical range, LAST inclusive
range="$(dmesg | sed -n 's/.*software IO TLB: mapped \[mem \(0x[0-9a-f]*\)-\(0x[0-9a-f]*\)\].*/\1 \2/p' | head -n1)"
pool_start=""; pool_end=""
if [ -n "$range" ]; then
    set -- $range
    pool_start=$(($1)); pool_end=$(($2 + 1))
fi

out=""
for b in /sys/block/vd*; do
    [ "$(cat "$b/serial" 2>/dev/null)" = "$serial" ] && out="/dev/${b##*/}"
done
[ -n "$out" ] || fail no-trace-disk "serial=$serial"
[ "$out" != "$dev" ] || fail trace-disk-is-the-workload-disk "dev=$dev"
i=0; while [ ! -b "$dev" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
[ -b "$dev" ] || fail no-device "dev=$dev"

# ---------------------------------------------------------------- probes
echo 0 > "$TR/tracing_on"
echo > "$TR/trace"
echo x86-tsc > "$TR/trace_clock" 2>/dev/null || echo global > "$TR/trace_clock"
echo 65536 > "$TR/buffer_size_kb"
area_args=""
a=0
while [ $a -lt "$nareas" ]; do
    area_args="$area_args used$a=+$((a * 16))(@io_tlb_default_mem+48):u64 idx$a=+$((a * 16 + 8))(@io_tlb_default_mem+48):u32"
    a=$((a + 1))
done
echo > "$TR/kprobe_events"
{
    echo "p:bvm/bvm_map swiotlb_tbl_map_single dev=%di:x64 orig=%si:u64 size=%dx:u64 aam=%cx:u32 dir=%r8:u32 attrs=%r9:u64 pstart=@io_tlb_default_mem:u64 pnslabs=@io_tlb_default_mem+24:u64 pnareas=@io_tlb_default_mem+36:u32"
    echo "r:bvm/bvm_mapret swiotlb_tbl_map_single ret=\$retval:u64$area_args"
    echo "p:bvm/bvm_unmap __swiotlb_tbl_unmap_single dev=%di:x64 tlb=%si:u64 size=%dx:u64 dir=%cx:u32 attrs=%r8:u64"
} > /tmp/kprobes
while read -r l; do
    echo "$l" >> "$TR/kprobe_events" 2>/tmp/kp.err || {
        echo "BVM-LOG kprobe refused: $l"; cat /tmp/kp.err | sed 's/^/BVM-LOG /'
        tail -n 5 "$TR/error_log" 2>/dev/null | sed 's/^/BVM-LOG /'
        fail kprobe-refused
    }
done < /tmp/kprobes
# The pool is not fresh: boot-time maps have moved each area's rolling index. Read every area's
# used count and index now, through a probe on uname(2) (which does no DMA), so the replay can
# start from the same state.
echo "p:bvm/bvm_state __x64_sys_newuname$area_args" >> "$TR/kprobe_events" 2>/tmp/kp.err || {
    cat /tmp/kp.err "$TR/error_log" 2>/dev/null | tail -n 5 | sed 's/^/BVM-LOG /'; fail kprobe-refused; }
echo 1 > "$TR/events/bvm/bvm_state/enable"
echo 1 > "$TR/tracing_on"
uname -r > /dev/null
echo 0 > "$TR/tracing_on"
echo 0 > "$TR/events/bvm/bvm_state/enable"
state="$(grep -m1 'bvm_state:' "$TR/trace")"
[ -n "$state" ] || fail no-area-state
start_used=""; start_index=""
a=0
while [ $a -lt "$nareas" ]; do
    u="$(echo "$state" | sed -n "s/.* used$a=\([0-9]*\).*/\1/p")"
    x="$(echo "$state" | sed -n "s/.* idx$a=\([0-9]*\).*/\1/p")"
    if [ $a -eq 0 ]; then start_used="$u"; start_index="$x"
    else start_used="$start_used,$u"; start_index="$start_index,$x"; fi
    a=$((a + 1))
done
echo > "$TR/trace"
echo 1 > "$TR/events/bvm/bvm_map/enable"
echo 1 > "$TR/events/bvm/bvm_mapret/enable"
echo 1 > "$TR/events/bvm/bvm_unmap/enable"
before="$(cat "$D/io_tlb_used") $(cat "$D/io_tlb_used_hiwater" 2>/dev/null || echo na)"

# ---------------------------------------------------------------- workload
echo 1 > "$TR/tracing_on"
fio --name=capture --filename="$dev" --ioengine=libaio --direct=1 --rw="${C_rw:-randrw}" \
    --bsrange="${C_bsrange:-512-256k}" --iodepth="${C_iodepth:-16}" --size="${C_size:-32M}" \
    --time_based --runtime="${C_runtime:-3}" --numjobs=1 --output=/tmp/fio.out >/tmp/fio.err 2>&1
fio_rc=$?
echo 0 > "$TR/tracing_on"
echo 0 > "$TR/events/bvm/enable"
after="$(cat "$D/io_tlb_used") $(cat "$D/io_tlb_used_hiwater" 2>/dev/null || echo na)"
[ $fio_rc -eq 0 ] || { tail -n 5 /tmp/fio.err /tmp/fio.out | sed 's/^/BVM-LOG /'; fail fio-error "rc=$fio_rc"; }

# Lost events make a trace useless for an exact replay: count them.
lost=0
for c in "$TR"/per_cpu/cpu*; do
    n="$(awk '/^(overrun|dropped events):/ {s += $NF} END {print s + 0}' "$c/stats")"
    lost=$((lost + n))
done
missed="$(awk '$1 ~ /bvm_/ {s += $3} END {print s + 0}' "$TR/kprobe_profile")"

# ---------------------------------------------------------------- convert
# Pool-level capture: every device's maps are kept (they share the pool); the map is placed at
# its entry event and completed by the next return on the same CPU. Any other swiotlb event
# between a map's entry and its return would make the order ambiguous: it is counted
# (interleaved_maps) and the test requires none (virtio-blk maps and unmaps under its
# virtqueue lock with interrupts off, so there are none for one queue).
cmdline="$(cat /proc/cmdline)"
awk -v nslabs="$nslabs" -v nareas="$nareas" -v pool_start="$pool_start" -v pool_end="$pool_end" -v kernel="$(uname -r)" \
    -v cmdline="$cmdline" -v cpus="$(grep -c ^processor /proc/cpuinfo)" -v lost="$lost" \
    -v missed="$missed" -v before="$before" -v after="$after" -v start_used="$start_used" \
    -v start_index="$start_index" '
function kv(s,   n, i, f, p) {
    delete V
    n = split(s, f, " ")
    for (i = 1; i <= n; i++) {
        p = index(f[i], "=")
        if (p > 1 && f[i] ~ /^[a-z0-9_]+=/) V[substr(f[i], 1, p - 1)] = substr(f[i], p + 1)
    }
}
function areas(   s, a) {
    s = ""
    for (a = 0; a < nareas; a++) s = s (a ? "," : "") V["used" a]
    u = s; s = ""
    for (a = 0; a < nareas; a++) s = s (a ? "," : "") V["idx" a]
    return s
}
# Operations are kept until no map is waiting for its return, then written out in order.
function flush(   i) {
    for (i = done + 1; i <= nops; i++) { if (op[i] != "") print op[i] > body; delete op[i]; delete inter[i] }
    done = nops
}
BEGIN { nops = 0; done = 0; id = 0; FAIL = "18446744073709551615"; body = "/tmp/trace.body" }
{
    if (!match($0, / \[[0-9]+\] /)) next
    cpu = substr($0, RSTART + 2, RLENGTH - 4) + 0
    rest = substr($0, RSTART + RLENGTH)
    if (!match(rest, /[0-9.]+: bvm_[a-z]+:/)) { unparsed++; next }
    hdr = substr(rest, RSTART, RLENGTH)
    split(hdr, h, ": ")
    ts = h[1]; ev = h[2]; sub(/:$/, "", ev)
    kv(substr(rest, RSTART + RLENGTH))
    nev++
    for (c in pend) if (c != cpu || ev != "bvm_mapret") inter[pend[c]] = 1
    if (ev == "bvm_map") {
        if (cpu in pend) entry_with_pending++
        if (!(V["dev"] in devs)) { devs[V["dev"]] = 1; ndev++; devlist = devlist (ndev > 1 ? "," : "") "\"" V["dev"] "\"" }
        if (pstart == "") { pstart = V["pstart"]; pnslabs = V["pnslabs"]; pnareas = V["pnareas"] }
        nops++
        op[nops] = sprintf("{\"op\":\"map\",\"id\":%d,\"orig\":%s,\"size\":%s,\"cpu\":%d,\"min_align_mask\":0,\"alloc_align_mask\":%s,\"dir\":%s,\"attrs\":%s,\"ts\":%s", id, V["orig"], V["size"], cpu, V["aam"], V["dir"], V["attrs"], ts)
        pend[cpu] = nops; pid[cpu] = id; id++; nmap++
    } else if (ev == "bvm_mapret") {
        if (!(cpu in pend)) { unpaired++; next }
        i = pend[cpu]; delete pend[cpu]
        ix = areas()
        tail = sprintf(",\"ret_ts\":%s", ts)
        if (i in inter) interleaved++
        else tail = tail sprintf(",\"kernel_area_used\":[%s],\"kernel_area_index\":[%s]", u, ix)
        if (V["ret"] == FAIL) { tail = tail ",\"kernel_tlb_addr\":null,\"kernel_error\":\"full\""; failed++ }
        else { tail = tail ",\"kernel_tlb_addr\":" V["ret"]; live[V["ret"]] = pid[cpu]; nlive++ }
        op[i] = op[i] tail "}"
    } else if (ev == "bvm_unmap") {
        if (!(V["tlb"] in live)) { unmatched++; next }
        nops++
        op[nops] = sprintf("{\"op\":\"unmap\",\"id\":%d,\"tlb_addr\":%s,\"size\":%s,\"cpu\":%d,\"dir\":%s,\"attrs\":%s,\"ts\":%s}", live[V["tlb"]], V["tlb"], V["size"], cpu, V["dir"], V["attrs"], ts)
        delete live[V["tlb"]]; nlive--; nunmap++
    }
    npend = 0
    for (c in pend) npend++
    if (!npend) flush()
}
END {
    for (c in pend) { pending++; op[pend[c]] = "" }
    flush()
    if (pool_start == "") { pool_start = pstart; pool_end = pstart + nslabs * 2048 }
    split(before, b, " "); split(after, a, " ")
    gsub(/"/, "\\\"", cmdline)
    printf "{\"op\":\"header\",\"format\":\"swiotlb-kernel-trace/1\",\"nslabs\":%d,\"nareas\":%d,\"area_nslabs\":%d,\"start\":%d,\"end\":%d,", nslabs, nareas, nslabs / nareas, pool_start, pool_end
    printf "\"min_align_mask\":0,\"seg_boundary_mask\":4294967295,\"force_bounce\":1,\"kernel\":\"%s\",\"cmdline\":\"%s\",\"cpus\":%d,", kernel, cmdline, cpus
    printf "\"probe_pool\":{\"start\":%s,\"nslabs\":%s,\"nareas\":%s},", (pstart == "" ? "null" : pstart), (pnslabs == "" ? "null" : pnslabs), (pnareas == "" ? "null" : pnareas)
    printf "\"debugfs_before\":{\"io_tlb_used\":%s,\"io_tlb_used_hiwater\":\"%s\"},\"debugfs_after\":{\"io_tlb_used\":%s,\"io_tlb_used_hiwater\":\"%s\"},", b[1], b[2], a[1], a[2]
    printf "\"area_used_at_start\":[%s],\"area_index_at_start\":[%s],", start_used, start_index
    printf "\"clock\":\"x86-tsc\",\"devices\":[%s],", devlist
    printf "\"counts\":{\"events\":%d,\"map\":%d,\"map_failed\":%d,\"unmap\":%d,\"unmatched_unmap\":%d,\"unpaired_return\":%d,\"entry_with_pending\":%d,\"interleaved_maps\":%d,\"pending_at_end\":%d,\"live_at_end\":%d,\"unparsed_lines\":%d,\"lost_events\":%d,\"kprobe_missed\":%d},", nev, nmap, failed, nunmap, unmatched, unpaired, entry_with_pending, interleaved, pending, nlive, unparsed, lost, missed
    printf "\"area_fields\":\"kernel_area_used/index: io_tlb_area.used/.index of each area read at the kretprobe of swiotlb_tbl_map_single; left out for a map with another swiotlb event between its entry and return\","
    printf "\"source\":\"bouncevm images/swiotlb-capture.sh: kprobe p:swiotlb_tbl_map_single(dev=%%di orig=%%si size=%%dx aam=%%cx dir=%%r8 attrs=%%r9), kretprobe $retval, p:__swiotlb_tbl_unmap_single(dev=%%di tlb=%%si size=%%dx dir=%%cx attrs=%%r8)\"}\n"
    printf "BVM-COUNTS maps=%d failed=%d unmaps=%d unmatched=%d unpaired=%d interleaved=%d pending=%d live=%d lost=%d missed=%d unparsed=%d pool_nslabs=%s pool_nareas=%s\n", nmap, failed, nunmap, unmatched, unpaired, interleaved, pending, nlive, lost, missed, unparsed, pnslabs, pnareas > "/tmp/counts"
}' "$TR/trace" > /tmp/trace.jsonl || fail convert-error
cat /tmp/trace.body >> /tmp/trace.jsonl && rm -f /tmp/trace.body
echo > "$TR/kprobe_events" 2>/dev/null
counts="$(sed 's/^BVM-COUNTS //' /tmp/counts)"
pn="$(echo "$counts" | sed -n 's/.*pool_nslabs=\([0-9]*\).*/\1/p')"
pa="$(echo "$counts" | sed -n 's/.*pool_nareas=\([0-9]*\).*/\1/p')"
if [ "$pn" != "$nslabs" ] || [ "$pa" != "$nareas" ]; then
    fail layout-mismatch "$counts debugfs_nslabs=$nslabs dmesg_nareas=$nareas"
fi

# ---------------------------------------------------------------- write out
gzip -c /tmp/trace.jsonl > /tmp/trace.jsonl.gz
gz_bytes="$(wc -c < /tmp/trace.jsonl.gz)"
sum="$(sha256sum /tmp/trace.jsonl.gz | cut -d' ' -f1)"
{ printf 'BVMTRACE1 %s %s\n' "$gz_bytes" "$sum"; head -c 4096 /dev/zero; } | head -c 4096 > /tmp/trace.hdr
dd if=/tmp/trace.hdr of="$out" bs=4096 count=1 conv=notrunc,fsync status=none || fail write-error
dd if=/tmp/trace.jsonl.gz of="$out" bs=4096 seek=1 conv=notrunc,fsync status=none || fail write-error
echo "BVM-RESULT test=$T status=ok $counts gz_bytes=$gz_bytes nslabs=$nslabs nareas=$nareas dev=$dev out=$out"
