#!/bin/sh
# Guest side of the swiotlb trace capture (busybox sh; run by /init for bvm.test=swiotlb-capture,
# installed in the initramfs as /usr/lib/bvm/swiotlb-capture.sh by images/build.sh).
#
# Inside a guest booted with swiotlb=<slots>,<areas>,force it records every swiotlb map and
# unmap of the running kernel while fio runs on a disk, converts the tracefs text to the
# kernel-trace format that bounce-replay reads (bounce/traces/README.md), gzips it and writes it
# to the raw disk whose virtio serial is bvm.trace_serial (default "bvmtrace"):
#
#   bytes 0..511   "BVMTRACE1 <gzip bytes> <sha256 of the gzip>\n", zero padded
#   bytes 4096..   the gzip'd JSON lines
#
# The trace disk must not bounce (no ACCESS_PLATFORM: virtio then bypasses the DMA API), and
# tracing is off before it is written, so the capture never records its own output.
#
# Two ways to record (bvm.capture=):
#   kprobes     (default) kprobes on swiotlb_tbl_map_single (arguments, return value and every
#               area's used count and rolling index read at the return) and
#               __swiotlb_tbl_unmap_single (arguments). Exact: swiotlb-kernel-trace/1.
#               dma:dma_unmap_page (6.12 and later) backs the unmap probe up: a kprobe that
#               fires while another probe's handler runs on the same CPU is skipped and only
#               counted (kprobe_profile "missed"); the trace event, emitted by the same
#               dma_unmap_page call right after the release, stands in for it.
#               On a kernel with CONFIG_SWIOTLB_DYNAMIC (debugfs has io_tlb_transient_nslabs)
#               it also records the dynamic pools, as swiotlb-kernel-trace/2: the allocator's
#               counters at every map's return, the pool each unmap released into, every
#               swiotlb_alloc_pool (a map's transient pool, right after its schedule_work of the
#               growth worker, and the worker's pools: address, nslabs, nareas, or the failure),
#               swiotlb_dyn_free, the worker's runs, and the moment each added pool
#               became visible to mappers (bvm.visible_at=SYMBOL+OFFSET: an instruction of
#               swiotlb_dyn_alloc after add_mem_pool's list_add_rcu, with the pool lock held;
#               images/build-dynamic-kernel.sh finds it; without it, the return of
#               swiotlb_dyn_alloc).
#   dma-events  the kernel's own trace events, no kprobes: swiotlb:swiotlb_bounced (at the entry
#               of swiotlb_map) and dma:dma_map_page / dma:dma_unmap_page (Linux 6.12 and
#               later). swiotlb-kernel-trace/1 without area state; each area's rolling index
#               at the start is the slot of the first map that landed in it.
#
# Parameters (kernel command line): bvm.dev=/dev/vda (the disk fio runs on), bvm.trace_serial,
# bvm.capture=kprobes, bvm.visible_at, bvm.runtime=3, bvm.size=32M, bvm.iodepth=16,
# bvm.bsrange=512-256k, bvm.rw=randrw, bvm.numjobs=1, bvm.skip_unmap_probe=0 (N: drop every Nth
# unmap probe event, to test the dma:dma_unmap_page backup).
# Prints BVM-INFO/BVM-LOG lines and one "BVM-RESULT test=swiotlb-capture ..." line.
#
# Layouts assumed (Linux 6.6-6.12, no lock debugging), checked at run time against debugfs,
# dmesg and the symbol table -- a mismatch fails the capture with reason=layout-mismatch -- and,
# for the fields read only when pools come and go (node, rcu, transient), by the consistency
# counts (unknown_pool, unknown_free) that an exact capture keeps at 0:
#   struct io_tlb_pool {start @0, end @8, vaddr @16, nslabs @24, late_alloc @32, nareas @36,
#     area_nslabs @40, areas @48, slots @56; with CONFIG_SWIOTLB_DYNAMIC also node @64,
#     rcu @80, transient @96}; struct io_tlb_area {used @0, index @8}, 16 bytes.
#   struct io_tlb_mem with CONFIG_SWIOTLB_DYNAMIC and CONFIG_DEBUG_FS: defpool @0, nslabs @104,
#     can_grow @122, phys_limit @128, pools @144, dyn_alloc @160 (its func @184),
#     total_used @192, used_hiwater @200, transient_nslabs @208.

T=swiotlb-capture
for w in $(cat /proc/cmdline); do
    case "$w" in
        bvm.*=*) k="${w%%=*}"; k="${k#bvm.}"; v="${w#*=}"
            case "$k" in *[!a-z0-9_]*) ;; *) eval "C_$k=\$v" ;; esac ;;
    esac
done
dev="${C_dev:-/dev/vda}"
serial="${C_trace_serial:-bvmtrace}"
mode="${C_capture:-kprobes}"
# Where the capture's time goes: the guest's uptime at the end of each phase.
phase() { echo "BVM-INFO phase=$1 uptime=$(cut -d' ' -f1 /proc/uptime)"; }
fail() { echo "BVM-RESULT test=$T status=fail reason=$1 ${2:-}"; exit 0; }
case "$mode" in kprobes|dma-events) ;; *) fail bad-capture-mode "capture=$mode" ;; esac

TR=/sys/kernel/tracing
[ -d "$TR/events" ] || mount -t tracefs nodev "$TR" 2>/dev/null
[ -w "$TR/kprobe_events" ] || [ "$mode" = dma-events ] || fail no-tracefs
[ -d "$TR/events" ] || fail no-tracefs
# What the kernel offers besides kprobes: its DMA-API trace events and their fields
evlist() { ls "$TR/events/$1" 2>/dev/null | grep -v -x -e enable -e filter | tr '\n' ',' | sed 's/,$//'; }
evfields() { sed -n 's/.*field:[^;]* \([a-z_]*\);.*/\1/p' "$TR/events/$1/format" 2>/dev/null | grep -v '^common_' | tr '\n' ',' | sed 's/,$//'; }
echo "BVM-INFO dma_events=$(evlist dma) swiotlb_events=$(evlist swiotlb)"
echo "BVM-INFO dma_map_page_fields=$(evfields dma/dma_map_page) dma_unmap_page_fields=$(evfields dma/dma_unmap_page) swiotlb_bounced_fields=$(evfields swiotlb/swiotlb_bounced)"
D=/sys/kernel/debug/swiotlb
[ -r "$D/io_tlb_nslabs" ] || fail no-swiotlb "hint=boot-with-swiotlb=N,A,force"
dyn=0
[ -r "$D/io_tlb_transient_nslabs" ] && dyn=1
nslabs="$(cat "$D/io_tlb_nslabs")"
# "area num N": the kernel's default_nareas (swiotlb_adjust_nareas); the default pool has
# limit_nareas(N, nslabs) of them (fewer when nslabs < N * 128).
default_nareas="$(dmesg | sed -n 's/.*software IO TLB: area num \([0-9]*\).*/\1/p' | head -n1)"
[ -n "$default_nareas" ] || default_nareas=1
nareas="$default_nareas"
[ "$nslabs" -lt $((nareas * 128)) ] && nareas=$((nslabs / 128))
# "mapped [mem START-LAST]": the pool's physical range, LAST inclusive
range="$(dmesg | sed -n 's/.*software IO TLB: mapped \[mem \(0x[0-9a-f]*\)-\(0x[0-9a-f]*\)\].*/\1 \2/p' | head -n1)"
pool_start=""; pool_end=""; pool_start_dmesg=0
if [ -n "$range" ]; then
    set -- $range
    pool_start=$(($1)); pool_end=$(($2 + 1)); pool_start_dmesg=1
fi

out=""
for b in /sys/block/vd*; do
    [ "$(cat "$b/serial" 2>/dev/null)" = "$serial" ] && out="/dev/${b##*/}"
done
[ -n "$out" ] || fail no-trace-disk "serial=$serial"
[ "$out" != "$dev" ] || fail trace-disk-is-the-workload-disk "dev=$dev"
i=0; while [ ! -b "$dev" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
[ -b "$dev" ] || fail no-device "dev=$dev"

# debugfs counters: io_tlb_used, io_tlb_used_hiwater, io_tlb_nslabs, io_tlb_transient_nslabs
counters() {
    echo "$(cat "$D/io_tlb_used") $(cat "$D/io_tlb_used_hiwater" 2>/dev/null || echo na)" \
        "$(cat "$D/io_tlb_nslabs") $(cat "$D/io_tlb_transient_nslabs" 2>/dev/null || echo na)"
}
ksym() { awk -v s="$1" '$3 == s {print $1; exit}' /proc/kallsyms; }

# ---------------------------------------------------------------- probes
echo 0 > "$TR/tracing_on"
echo > "$TR/trace"
echo x86-tsc > "$TR/trace_clock" 2>/dev/null || echo global > "$TR/trace_clock"
echo 65536 > "$TR/buffer_size_kb"
[ -w "$TR/kprobe_events" ] && echo > "$TR/kprobe_events"
M=io_tlb_default_mem
area_args=""
a=0
while [ $a -lt "$nareas" ]; do
    area_args="$area_args used$a=+$((a * 16))(@$M+48):u64 idx$a=+$((a * 16 + 8))(@$M+48):u32"
    a=$((a + 1))
done
addprobe() {
    echo "$1" >> "$TR/kprobe_events" 2>/tmp/kp.err || {
        echo "BVM-LOG kprobe refused: $1"; sed 's/^/BVM-LOG /' /tmp/kp.err
        tail -n 5 "$TR/error_log" 2>/dev/null | sed 's/^/BVM-LOG /'
        fail kprobe-refused
    }
}
apool=""; visible_probe=""; backstop=0
if [ "$mode" = dma-events ]; then
    for e in swiotlb/swiotlb_bounced dma/dma_map_page dma/dma_unmap_page; do
        [ -w "$TR/events/$e/enable" ] || fail no-dma-events "missing=$e"
    done
    events="swiotlb/swiotlb_bounced dma/dma_map_page dma/dma_unmap_page"
    state=""
else
    addprobe "p:bvm/bvm_map swiotlb_tbl_map_single dev=%di:x64 orig=%si:u64 size=%dx:u64 aam=%cx:u32 dir=%r8:u32 attrs=%r9:u64 pstart=@$M:u64 pnslabs=@$M+24:u64 pnareas=@$M+36:u32"
    if [ $dyn = 0 ]; then
        addprobe "r:bvm/bvm_mapret swiotlb_tbl_map_single ret=\$retval:u64$area_args"
        addprobe "p:bvm/bvm_unmap __swiotlb_tbl_unmap_single dev=%di:x64 tlb=%si:u64 size=%dx:u64 dir=%cx:u32 attrs=%r8:u64"
        events="bvm/bvm_map bvm/bvm_mapret bvm/bvm_unmap"
    else
        mem_args="mnslabs=@$M+104:u64 used=@$M+192:u64 hiwater=@$M+200:u64 transient=@$M+208:u64"
        # the pool at the head of mem->pools (the newest: list_add_rcu adds at the head)
        head_args="hstart=-64(@$M+144):u64 hnslabs=-40(@$M+144):u64 hnareas=-28(@$M+144):u32"
        addprobe "r:bvm/bvm_mapret swiotlb_tbl_map_single ret=\$retval:u64$area_args $mem_args"
        addprobe "p:bvm/bvm_unmap __swiotlb_tbl_unmap_single dev=%di:x64 tlb=%si:u64 size=%dx:u64 dir=%cx:u32 attrs=%r8:u64 ppstart=+0(%r9):u64 ppnslabs=+24(%r9):u64 pptransient=+96(%r9):u8"
        # swiotlb_alloc_pool(dev, minslabs, nslabs, nareas, phys_limit, gfp); gcc may drop the
        # unused dev (swiotlb_alloc_pool.isra.N: minslabs, nslabs, nareas, phys_limit, gfp).
        apool="$(awk '$3 ~ /^swiotlb_alloc_pool(\.|$)/ {print $3; exit}' /proc/kallsyms)"
        [ -n "$apool" ] || fail no-symbol "swiotlb_alloc_pool"
        case "$apool" in
            swiotlb_alloc_pool) ap="min=%si:u64 want=%dx:u64 wareas=%cx:u32 limit=%r8:x64 gfp=%r9:x32" ;;
            *) ap="min=%di:u64 want=%si:u64 wareas=%dx:u32 limit=%cx:x64 gfp=%r8:x32" ;;
        esac
        addprobe "p:bvm/bvm_apool $apool $ap"
        addprobe "r:bvm/bvm_apoolret $apool ret=\$retval:x64 start=+0(\$retval):u64 nslabs=+24(\$retval):u64 nareas=+36(\$retval):u32"
        addprobe "p:bvm/bvm_dynfree swiotlb_dyn_free start=-80(%di):u64 nslabs=-56(%di):u64"
        addprobe "p:bvm/bvm_worker swiotlb_dyn_alloc"
        if [ -n "${C_visible_at:-}" ]; then
            visible_probe="$C_visible_at"
            addprobe "p:bvm/bvm_visible $C_visible_at $head_args $mem_args"
            addprobe "r:bvm/bvm_workerret swiotlb_dyn_alloc"
        else
            visible_probe="swiotlb_dyn_alloc%return"
            addprobe "r:bvm/bvm_workerret swiotlb_dyn_alloc $head_args $mem_args"
        fi
        dynalloc="$(ksym swiotlb_dyn_alloc)"
        [ -n "$dynalloc" ] || fail no-symbol "swiotlb_dyn_alloc"
        events="bvm/bvm_map bvm/bvm_mapret bvm/bvm_unmap bvm/bvm_apool bvm/bvm_apoolret bvm/bvm_dynfree bvm/bvm_worker bvm/bvm_workerret"
        [ -n "${C_visible_at:-}" ] && events="$events bvm/bvm_visible"
    fi
    if [ -w "$TR/events/dma/dma_unmap_page/enable" ]; then
        events="$events dma/dma_unmap_page"; backstop=1
    fi
    # The pool is not fresh: boot-time maps have moved each area's rolling index. Read every
    # area's used count and index now, through a probe on uname(2) (which does no DMA), so the
    # replay can start from the same state; on a dynamic kernel also the allocator's fields
    # whose offsets the capture relies on.
    st="$area_args"
    [ $dyn = 1 ] && st="$st pnslabs=@$M+24:u64 $mem_args $head_args cangrow=@$M+122:u8 plimit=@$M+128:x64 wfunc=@$M+184:x64"
    addprobe "p:bvm/bvm_state __x64_sys_newuname$st spstart=@$M:u64"
    echo 1 > "$TR/events/bvm/bvm_state/enable"
    echo 1 > "$TR/tracing_on"
    uname -r > /dev/null
    echo 0 > "$TR/tracing_on"
    echo 0 > "$TR/events/bvm/bvm_state/enable"
    state="$(grep -m1 'bvm_state:' "$TR/trace")"
    [ -n "$state" ] || fail no-area-state
fi
field() { echo "$state" | sed -n "s/.* $1=\([0-9a-fx]*\).*/\1/p"; }
start_used=""; start_index=""
if [ -n "$state" ]; then
    a=0
    while [ $a -lt "$nareas" ]; do
        u="$(field "used$a")"; x="$(field "idx$a")"
        if [ $a -eq 0 ]; then start_used="$u"; start_index="$x"
        else start_used="$start_used,$u"; start_index="$start_index,$x"; fi
        a=$((a + 1))
    done
fi
# The "mapped" line is printed only when x86 itself wanted swiotlb (pci_iommu_init); a kernel
# without memory hotplug sees no memory above 4 GiB and prints none: the pool's start then
# comes from the probe.
if [ -z "$pool_start" ] && [ -n "$state" ]; then
    pool_start="$(field spstart)"; pool_end=$((pool_start + nslabs * 2048))
fi
can_grow=""; phys_limit=""
if [ $dyn = 1 ] && [ "$mode" = kprobes ]; then
    # Offsets of struct io_tlb_mem: its counters against debugfs, the pool list's head against
    # the default pool (no pool added yet), dyn_alloc's function against the symbol.
    set -- $(counters)
    why=""
    [ "$(field mnslabs)" = "$3" ] || why="$why mem.nslabs=$(field mnslabs)/debugfs=$3"
    [ "$(field pnslabs)" = "$3" ] || why="$why defpool.nslabs=$(field pnslabs)/debugfs=$3"
    [ "$(field used)" = "$1" ] || why="$why total_used=$(field used)/debugfs=$1"
    [ "$(field hiwater)" = "$2" ] || why="$why used_hiwater=$(field hiwater)/debugfs=$2"
    [ "$(field transient)" = "$4" ] || why="$why transient_nslabs=$(field transient)/debugfs=$4"
    [ "$(field hstart)" = "$(field spstart)" ] || why="$why pools.head.start=$(field hstart)/defpool.start=$(field spstart)"
    [ "$(field wfunc)" = "0x$dynalloc" ] || why="$why dyn_alloc.func=$(field wfunc)/swiotlb_dyn_alloc=0x$dynalloc"
    [ -z "$why" ] || fail layout-mismatch "$(echo $why | tr ' ' ',')"
    can_grow="$(field cangrow)"; phys_limit="$(field plimit)"
fi
echo > "$TR/trace"
for e in $events; do echo 1 > "$TR/events/$e/enable"; done
before="$(counters)"

# ---------------------------------------------------------------- workload
echo 1 > "$TR/tracing_on"
fio --name=capture --filename="$dev" --ioengine=libaio --direct=1 --rw="${C_rw:-randrw}" \
    --bsrange="${C_bsrange:-512-256k}" --iodepth="${C_iodepth:-16}" --size="${C_size:-32M}" \
    --time_based --runtime="${C_runtime:-3}" --numjobs="${C_numjobs:-1}" --output=/tmp/fio.out >/tmp/fio.err 2>&1
fio_rc=$?
echo 0 > "$TR/tracing_on"
phase fio
for e in $events; do echo 0 > "$TR/events/$e/enable"; done
after="$(counters)"
[ $fio_rc -eq 0 ] || { tail -n 5 /tmp/fio.err /tmp/fio.out | sed 's/^/BVM-LOG /'; fail fio-error "rc=$fio_rc"; }

# Lost events make a trace useless for an exact replay: count them.
lost=0
for c in "$TR"/per_cpu/cpu*; do
    n="$(awk '/^(overrun|dropped events):/ {s += $NF} END {print s + 0}' "$c/stats")"
    lost=$((lost + n))
done
missed="$(awk '$1 ~ /bvm_/ {s += $3} END {print s + 0}' "$TR/kprobe_profile" 2>/dev/null)"
[ -n "$missed" ] || missed=0
missed_unmap="$(awk '$1 ~ /bvm_unmap$/ {s += $3} END {print s + 0}' "$TR/kprobe_profile" 2>/dev/null)"
[ -n "$missed_unmap" ] || missed_unmap=0
[ "$missed" = 0 ] || awk '$1 ~ /bvm_/ && $3 > 0 {print "BVM-LOG kprobe missed: " $0}' "$TR/kprobe_profile"

# ---------------------------------------------------------------- convert
# Pool-level capture: every device's maps are kept (they share the pool); the map is placed at
# its entry event and completed by the next return on the same CPU. Any other swiotlb event
# between a map's entry and its return would make the order ambiguous: it is counted
# (interleaved_maps) and the test requires none (virtio-blk maps and unmaps under its
# virtqueue lock with interrupts off, so there are none for one queue). The dynamic pools'
# events of the mapping CPU inside that window (schedule_work, swiotlb_alloc_pool,
# swiotlb_dyn_free) belong to the map.
cmdline="$(cat /proc/cmdline)"
# mawk when the image has it (images/build.sh): the conversion is most of a capture's time.
AWK="$(command -v mawk || echo awk)"
"$AWK" -v nslabs="$nslabs" -v nareas="$nareas" -v default_nareas="$default_nareas" -v dyn="$dyn" \
    -v mode="$mode" -v pool_start="$pool_start" -v pool_end="$pool_end" -v kernel="$(uname -r)" \
    -v cmdline="$cmdline" -v cpus="$(grep -c ^processor /proc/cpuinfo)" -v lost="$lost" \
    -v missed="$missed" -v missed_unmap="$missed_unmap" -v backstop="$backstop" -v skip_unmap="${C_skip_unmap_probe:-0}" -v before="$before" -v after="$after" -v start_used="$start_used" \
    -v start_index="$start_index" -v can_grow="$can_grow" -v phys_limit="$phys_limit" \
    -v apool="$apool" -v visible_probe="$visible_probe" -v pool_start_dmesg="$pool_start_dmesg" '
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
# Operations are kept until no map is waiting for its return (and no growth worker is between
# its entry and return), then written out in order; pre[i] lines go right before op[i].
function flush(   i) {
    for (i = done + 1; i <= nops; i++) {
        if (i in pre) print pre[i] > body
        if (op[i] != "") print op[i] > body
        delete op[i]; delete inter[i]; delete pre[i]; delete racing[i]
    }
    done = nops
}
function hexnum(s,   n, i, c) {  # a hex string ("0x..." or "...") to a number; exact below 2^53
    sub(/^0x/, "", s); n = 0
    for (i = 1; i <= length(s); i++) { c = index("0123456789abcdef", tolower(substr(s, i, 1))) - 1; n = n * 16 + c }
    return n
}
function attr_bits(s,   n, f, i, b) {  # decode_dma_attrs names to DMA_ATTR_* bits
    n = split(s, f, "|"); b = 0
    for (i = 1; i <= n; i++) b += (f[i] in ATTR) ? ATTR[f[i]] : 0
    return b
}
# Which pool holds a bounce address: sets pk (kind) and ps (pool start); "" when none.
function lookup(addr,   s) {
    pk = ""; ps = ""
    if (addr + 0 >= pool_start + 0 && addr + 0 < pool_end + 0) { pk = "default"; ps = pool_start; return }
    for (s in ADDED) if (addr + 0 >= s + 0 && addr + 0 < s + ADDED[s] * 2048) { pk = "added"; ps = s; return }
    for (s in TRANS) if (addr + 0 >= s + 0 && addr + 0 < s + TRANS[s] * 2048) { pk = "transient"; ps = s; return }
}
function addpre(i, line) { pre[i] = (i in pre) ? pre[i] "\n" line : line }
function json_pool_add(s, n, a, t, w) {
    return sprintf("{\"op\":\"pool_add\",\"start\":%s,\"nslabs\":%s,\"nareas\":%s,\"ts\":%s,\"worker_ts\":%s,\"alloc_ts\":%s}", s, n, a, t, w, W_ATS)
}
BEGIN {
    nops = 0; done = 0; id = 0; FAIL = "18446744073709551615"; body = "/tmp/trace.body"; working = 0
    DIRN["BIDIRECTIONAL"] = 0; DIRN["TO_DEVICE"] = 1; DIRN["FROM_DEVICE"] = 2; DIRN["NONE"] = 3
    ATTR["WEAK_ORDERING"] = 2; ATTR["WRITE_COMBINE"] = 4; ATTR["NO_KERNEL_MAPPING"] = 16
    ATTR["SKIP_CPU_SYNC"] = 32; ATTR["FORCE_CONTIGUOUS"] = 64; ATTR["ALLOC_SINGLE_PAGES"] = 128
    ATTR["NO_WARN"] = 256; ATTR["PRIVILEGED"] = 512
    area_nslabs = nslabs / nareas; cur_nslabs = nslabs
    # the trace events cannot see the dynamic pools: only the kprobe capture records them
    kdyn = dyn; if (mode != "kprobes") dyn = 0
}
{
    if (!match($0, / \[[0-9]+\] /)) next
    cpu = substr($0, RSTART + 2, RLENGTH - 4) + 0
    task = substr($0, 1, RSTART - 1); sub(/^ +/, "", task)
    pid = task; sub(/.*-/, "", pid)
    rest = substr($0, RSTART + RLENGTH)
    if (!match(rest, /[0-9.]+: (bvm_[a-z]+|swiotlb_bounced|dma_map_page|dma_unmap_page):/)) { unparsed++; next }
    hdr = substr(rest, RSTART, RLENGTH)
    split(hdr, h, ": ")
    ts = h[1]; ev = h[2]; sub(/:$/, "", ev)
    args = substr(rest, RSTART + RLENGTH)
    if (ev == "swiotlb_bounced") { sub(/^ *dev_name: /, "", args); evdev = args; sub(/ .*/, "", evdev) }
    else if (ev == "dma_map_page" || ev == "dma_unmap_page") { sub(/^ +/, "", args); evdev = args; sub(/ .*/, "", evdev) }
    kv(args)
    nev++
    # bvm.skip_unmap_probe=N: every Nth unmap probe event is dropped, as if the kprobe had been
    # skipped, to check that the trace event restores it
    if (ev == "bvm_unmap" && skip_unmap > 0 && ++unmap_probe_hits % skip_unmap == 0) { injected++; next }
    # dma_unmap_page beside the unmap kprobe: dropped when the probe saw that unmap, the unmap
    # itself when the probe was skipped (same CPU, same call, right after the release)
    if (backstop && ev == "dma_unmap_page") {
        t = sprintf("%.0f", hexnum(V["dma_addr"]))
        if (KP[t] > 0) { if (--KP[t] == 0) delete KP[t]; next }
        if (!(t in live)) { unmatched++; next }
        recovered++
    }
    # A map or unmap on another CPU inside the window of a map makes the order ambiguous; the
    # events of the dynamic pools a map causes happen inside its own window, and the growth
    # worker allocates without touching a slot (its pool becoming visible is handled below).
    if (ev == "bvm_map" || ev == "bvm_mapret" || ev == "bvm_unmap" || ev == "swiotlb_bounced" || ev == "dma_map_page" || ev == "dma_unmap_page")
        for (c in pend) if (c != cpu || (ev != "bvm_mapret" && ev != "dma_map_page")) inter[pend[c]] = 1
    if (ev == "bvm_map" || ev == "swiotlb_bounced") {
        if (cpu in pend) entry_with_pending++
        if (ev == "bvm_map") {
            d = V["dev"]; o = V["orig"]; sz = V["size"]; aam = V["aam"]; dr = V["dir"]; at = V["attrs"]
            if (pstart == "") { pstart = V["pstart"]; pnslabs = V["pnslabs"]; pnareas = V["pnareas"] }
        } else {
            # swiotlb_bounced only opens the map: dma_map_page carries its arguments
            d = evdev; o = ""; aam = 0
        }
        if (!(d in devs)) { devs[d] = 1; ndev++; devlist = devlist (ndev > 1 ? "," : "") "\"" d "\"" }
        nops++
        if (ev == "bvm_map")
            op[nops] = sprintf("{\"op\":\"map\",\"id\":%d,\"orig\":%s,\"size\":%s,\"cpu\":%d,\"min_align_mask\":0,\"alloc_align_mask\":%s,\"dir\":%s,\"attrs\":%s,\"ts\":%s", id, o, sz, cpu, aam, dr, at, ts)
        else
            op[nops] = sprintf("{\"op\":\"map\",\"id\":%d,\"cpu\":%d,\"min_align_mask\":0,\"alloc_align_mask\":0,\"ts\":%s", id, cpu, ts)
        pend[cpu] = nops; pid_of[cpu] = id; id++; nmap++
    } else if (ev == "bvm_mapret" || ev == "dma_map_page") {
        if (!(cpu in pend)) {
            if (ev == "dma_map_page") not_bounced++
            else unpaired++
            next
        }
        i = pend[cpu]; delete pend[cpu]
        # between the allocation by the growth worker and the probe that sees its pool published,
        # this map may have read mem->nslabs with the new pool in it (several CPUs)
        # (seen on two vCPUs: the worker stopped between list_add_rcu and the probe while the
        # other vCPU ran maps); a map whose mem->nslabs is not the sum of the pools published
        # so far read it after a publication the trace has not reached yet
        if (dyn && (W_START != "" || V["mnslabs"] != cur_nslabs)) { racing[i] = 1; nracing++ }
        if (ev == "dma_map_page") {
            ret = (V["dma_addr"] == "ffffffffffffffff") ? FAIL : sprintf("%.0f", hexnum(V["dma_addr"]))
            op[i] = op[i] sprintf(",\"orig\":%.0f,\"size\":%s,\"dir\":%d,\"attrs\":%d", hexnum(V["phys_addr"]), V["size"], DIRN[V["dir"]], attr_bits(V["attrs"]))
        } else ret = V["ret"]
        tail = sprintf(",\"ret_ts\":%s", ts)
        if (i in inter) interleaved++
        else if (ev == "bvm_mapret") {
            ix = areas()
            tail = tail sprintf(",\"kernel_area_used\":[%s],\"kernel_area_index\":[%s]", u, ix)
            # a pool published while the map ran may or may not be in the counters it read
            if (dyn && !(i in racing)) tail = tail sprintf(",\"kernel_nslabs\":%s,\"kernel_used\":%s,\"kernel_hiwater\":%s,\"kernel_transient_nslabs\":%s", V["mnslabs"], V["used"], V["hiwater"], V["transient"])
        }
        if (dyn && (i in grow)) tail = tail ",\"kernel_grow\":true"
        if (ret == FAIL) { tail = tail ",\"kernel_tlb_addr\":null,\"kernel_error\":\"full\""; failed++ }
        else {
            tail = tail ",\"kernel_tlb_addr\":" ret
            # an address handed out while still live: an unmap went unrecorded
            if (ret in live) reused++
            live[ret] = pid_of[cpu]; nlive++
            lookup(ret)
            if (dyn) {
                if (pk == "") { unknown_pool++; tail = tail ",\"kernel_pool\":null" }
                else {
                    tail = tail sprintf(",\"kernel_pool\":%s,\"kernel_pool_kind\":\"%s\"", ps, pk)
                    if (pk == "added") {
                        nin_added++
                        if (!(ps in VISIBLE) && !(ps in early)) early[ps] = i
                    } else if (pk == "transient") nin_trans++
                }
            } else if (mode == "dma-events") {
                # placed against the pool at the end, when its start is known
                nsucc++; SEQ[nsucc] = ret
                if (lo_addr == "" || ret + 0 < lo_addr + 0) lo_addr = ret
                e = ret + V["size"]
                if (hi_end == "" || e > hi_end + 0) hi_end = e
            }
        }
        op[i] = op[i] tail "}"
    } else if (ev == "bvm_unmap" || ev == "dma_unmap_page") {
        t = (ev == "bvm_unmap") ? V["tlb"] : sprintf("%.0f", hexnum(V["dma_addr"]))
        if (!(t in live)) { unmatched++; next }
        nops++
        if (ev == "bvm_unmap")
            op[nops] = sprintf("{\"op\":\"unmap\",\"id\":%d,\"tlb_addr\":%s,\"size\":%s,\"cpu\":%d,\"dir\":%s,\"attrs\":%s,\"ts\":%s}", live[t], t, V["size"], cpu, V["dir"], V["attrs"], ts)
        else
            op[nops] = sprintf("{\"op\":\"unmap\",\"id\":%d,\"tlb_addr\":%s,\"size\":%s,\"cpu\":%d,\"dir\":%d,\"attrs\":%d,\"ts\":%s}", live[t], t, V["size"], cpu, DIRN[V["dir"]], attr_bits(V["attrs"]), ts)
        if (ev == "bvm_unmap" && backstop) KP[t]++
        # the pool the slots went back to: the probe reads it, the trace event has the address
        s = ""
        if (dyn && ev == "bvm_unmap" && V["pptransient"] == 1) { s = V["ppstart"]; sn = V["ppnslabs"] }
        else if (dyn && ev == "dma_unmap_page") { lookup(t); if (pk == "transient") { s = ps; sn = TRANS[ps] } }
        if (s != "") {
            # __swiotlb_tbl_unmap_single -> swiotlb_del_transient: the whole pool goes
            if (!(s in TRANS)) unknown_transient_free++
            else {
                op[nops] = op[nops] "\n" sprintf("{\"op\":\"transient_free\",\"id\":%d,\"start\":%s,\"nslabs\":%s,\"ts\":%s}", live[t], s, sn, ts)
                GONE[s] = 1; delete TRANS[s]; ntfree++
            }
        }
        delete live[t]; nlive--; nunmap++
    } else if (ev == "bvm_apool") {
        AP_GFP[pid] = V["gfp"]; AP_MIN[pid] = V["min"]; AP_WANT[pid] = V["want"]; AP_AREAS[pid] = V["wareas"]
        AP_MAP[pid] = (cpu in pend) ? pend[cpu] : 0
        # the worker asks for GFP_KERNEL (0xcc0) pools of at least IO_TLB_MIN_SLABS; a map for
        # a one-area pool of exactly its size
        if (V["gfp"] == "0xcc0") { if (V["min"] != 512) apool_args_unexpected++ }
        else if (V["min"] != V["want"] || V["wareas"] != 1 || !(cpu in pend)) apool_args_unexpected++
        else {
            # swiotlb_find_slots calls schedule_work(&mem->dyn_alloc) right before it asks for
            # a transient pool, and nowhere else: this map requested growth
            grow[pend[cpu]] = 1; ngrow++
        }
    } else if (ev == "bvm_apoolret") {
        if (!(pid in AP_GFP)) { unpaired_apool++; next }
        ok = (V["ret"] != "0x0")
        if (AP_GFP[pid] == "0xcc0") {
            # the growth worker: visible later (bvm_visible / the worker return)
            if (ok) { W_START = V["start"]; W_N = V["nslabs"]; W_A = V["nareas"]; W_ATS = ts; ADDED[W_START] = W_N }
            else { W_START = ""; nworker_alloc_failed++ }
        } else {
            i = AP_MAP[pid]
            if (!ok) {
                line = sprintf("{\"op\":\"transient_alloc\",\"id\":%d,\"failed\":true,\"nslabs\":%s,\"ts\":%s}", pid_of[cpu], AP_WANT[pid], ts)
                ntalloc_failed++
            } else {
                line = sprintf("{\"op\":\"transient_alloc\",\"id\":%d,\"start\":%s,\"nslabs\":%s,\"nareas\":%s,\"ts\":%s}", pid_of[cpu], V["start"], V["nslabs"], V["nareas"], ts)
                TRANS[V["start"]] = V["nslabs"]; T_MAP[V["start"]] = i; ntalloc++
            }
            # an input of the map it serves: it goes right before that map
            addpre(i, line)
        }
        delete AP_GFP[pid]
    } else if (ev == "bvm_dynfree") {
        s = V["start"]
        if ((s in TRANS) && (cpu in pend) && T_MAP[s] == pend[cpu]) {
            # swiotlb_find_slots: no fit in the fresh transient pool; freed at once
            tsearch_failed++; delete TRANS[s]
            addpre(pend[cpu], sprintf("{\"op\":\"transient_free\",\"id\":%d,\"start\":%s,\"nslabs\":%s,\"search_failed\":true,\"ts\":%s}", pid_of[cpu], s, V["nslabs"], ts))
        } else if (s in GONE) rcu_free++
        else unknown_free++
    } else if (ev == "bvm_worker") {
        working++; W_TS = ts; W_START = ""; nworker++
    } else if (ev == "bvm_visible" || (ev == "bvm_workerret" && visible_probe ~ /%return$/)) {
        if (ev == "bvm_workerret") working--
        if (W_START == "" ) { if (ev == "bvm_visible") unexpected_visible++; }
        else if (V["hstart"] != W_START || V["hnslabs"] != W_N || V["hnareas"] != W_A) pool_head_mismatch++
        else {
            for (c in pend) { racing[pend[c]] = 1; nracing++ }
            nops++
            op[nops] = json_pool_add(W_START, W_N, W_A, ts, W_TS)
            VISIBLE[W_START] = 1; nadd++; added_nslabs += W_N; cur_nslabs += W_N
            if (W_START in early) {
                # a map landed in the pool before the probe saw it published (another CPU,
                # between list_add_rcu and the probe): the pool was visible before that map
                addpre(early[W_START], op[nops])
                op[nops] = ""; pool_add_moved++
            }
            W_START = ""
        }
    } else if (ev == "bvm_workerret") {
        working--
        if (W_START != "") { worker_without_visible++; W_START = "" }
    }
    npend = 0
    for (c in pend) npend++
    if (!npend && working <= 0) flush()
}
END {
    missed += injected
    for (c in pend) { pending++; op[pend[c]] = "" }
    flush()
    if (pool_start == "") { pool_start = pstart; pool_end = pstart + nslabs * 2048 }
    split(before, b, " "); split(after, a, " ")
    gsub(/"/, "\\\"", cmdline)
    start_source = (pool_start_dmesg ? "dmesg" : "probe")
    if (mode == "dma-events") {
        # Without kprobes the pool start is the dmesg "mapped" line, or inferred: page-aligned
        # (memblock_alloc_low), at most the lowest bounce address, at least the highest end
        # minus the pool size. Exact when the trace used both ends of the pool.
        cand_hi = int(lo_addr / 4096) * 4096
        cand_lo = hi_end - nslabs * 2048
        cand_lo = (cand_lo <= 0) ? 0 : int((cand_lo + 4095) / 4096) * 4096
        if (!pool_start_dmesg) {
            pool_start = cand_hi; pool_end = pool_start + nslabs * 2048
            start_source = (cand_lo == cand_hi) ? "inferred-exact" : (cand_lo < cand_hi ? "inferred-ambiguous" : "inferred-inconsistent")
        }
        for (k = 1; k <= nsucc; k++) {
            r = SEQ[k]
            if (r + 0 < pool_start + 0 || r + 0 >= pool_end + 0) { outside_default++; continue }
            x = int((r - pool_start) / 2048 / area_nslabs)
            if (!(x in first_idx)) first_idx[x] = int((r - pool_start) / 2048) - x * area_nslabs
        }
        # each area starts where its first map landed (the pool is empty when tracing starts:
        # debugfs_before.io_tlb_used == 0); an area nobody used keeps 0
        start_index = ""; start_used = ""
        for (x = 0; x < nareas; x++) {
            start_index = start_index (x ? "," : "") ((x in first_idx) ? first_idx[x] : 0)
            start_used = start_used (x ? "," : "") "0"
        }
    }
    printf "{\"op\":\"header\",\"format\":\"swiotlb-kernel-trace/%d\",\"nslabs\":%d,\"nareas\":%d,\"area_nslabs\":%d,\"start\":%d,\"end\":%d,", dyn ? 2 : 1, nslabs, nareas, nslabs / nareas, pool_start, pool_end
    printf "\"min_align_mask\":0,\"seg_boundary_mask\":4294967295,\"force_bounce\":1,\"kernel\":\"%s\",\"cmdline\":\"%s\",\"cpus\":%d,", kernel, cmdline, cpus
    if (mode == "kprobes")
        printf "\"probe_pool\":{\"start\":%s,\"nslabs\":%s,\"nareas\":%s},", (pstart == "" ? "null" : pstart), (pnslabs == "" ? "null" : pnslabs), (pnareas == "" ? "null" : pnareas)
    printf "\"debugfs_before\":{\"io_tlb_used\":%s,\"io_tlb_used_hiwater\":\"%s\"", b[1], b[2]
    if (kdyn) printf ",\"io_tlb_nslabs\":%s,\"io_tlb_transient_nslabs\":%s", b[3], b[4]
    printf "},\"debugfs_after\":{\"io_tlb_used\":%s,\"io_tlb_used_hiwater\":\"%s\"", a[1], a[2]
    if (kdyn) printf ",\"io_tlb_nslabs\":%s,\"io_tlb_transient_nslabs\":%s", a[3], a[4]
    printf "},"
    printf "\"area_used_at_start\":[%s],\"area_index_at_start\":[%s],", start_used, start_index
    if (dyn) {
        printf "\"dynamic\":{\"default_nareas\":%d,\"default_nslabs\":%d,\"can_grow\":%s,\"phys_limit\":%.0f,\"alloc_pool_symbol\":\"%s\",\"visible_probe\":\"%s\"},", default_nareas, nslabs, can_grow, hexnum(phys_limit), apool, visible_probe
    }
    printf "\"start_source\":\"%s\",", start_source
    if (mode == "dma-events") printf "\"start_candidates\":[%.0f,%.0f],\"kernel_dynamic_pools\":%d,", cand_lo, cand_hi, kdyn
    printf "\"clock\":\"x86-tsc\",\"devices\":[%s],", devlist
    printf "\"counts\":{\"events\":%d,\"map\":%d,\"map_failed\":%d,\"unmap\":%d,\"unmatched_unmap\":%d,\"unpaired_return\":%d,\"entry_with_pending\":%d,\"interleaved_maps\":%d,\"pending_at_end\":%d,\"live_at_end\":%d,\"unparsed_lines\":%d,\"lost_events\":%d,\"kprobe_missed\":%d,\"unmap_probe_skipped\":%d,\"unmap_recovered\":%d,\"kprobe_unrecovered\":%d,\"live_reused\":%d", nev, nmap, failed, nunmap, unmatched, unpaired, entry_with_pending, interleaved, pending, nlive, unparsed, lost, missed, injected, recovered, missed - recovered, reused
    if (mode == "dma-events") printf ",\"not_bounced\":%d,\"outside_default_pool\":%d", not_bounced, outside_default
    if (dyn) {
        printf ",\"grow_requests\":%d,\"worker_runs\":%d,\"worker_alloc_failed\":%d,\"pool_add\":%d,\"added_nslabs\":%d,\"pool_add_moved\":%d,\"maps_racing_pool_add\":%d,\"pool_head_mismatch\":%d,\"worker_without_visible\":%d,\"unexpected_visible\":%d", ngrow, nworker, nworker_alloc_failed, nadd, added_nslabs, pool_add_moved, nracing, pool_head_mismatch, worker_without_visible, unexpected_visible
        printf ",\"transient_alloc\":%d,\"transient_alloc_failed\":%d,\"transient_search_failed\":%d,\"transient_free\":%d,\"maps_in_added\":%d,\"maps_in_transient\":%d,\"unknown_pool\":%d,\"unknown_transient_free\":%d,\"rcu_free\":%d,\"unknown_free\":%d,\"unpaired_alloc_pool\":%d,\"alloc_pool_args_unexpected\":%d", ntalloc, ntalloc_failed, tsearch_failed, ntfree, nin_added, nin_trans, unknown_pool, unknown_transient_free, rcu_free, unknown_free, unpaired_apool, apool_args_unexpected
    }
    printf "},"
    if (mode == "dma-events") {
        printf "\"source\":\"bouncevm images/swiotlb-capture.sh bvm.capture=dma-events: trace events swiotlb:swiotlb_bounced (opens a map), dma:dma_map_page (phys_addr, dma_addr = the bounce address, size, dir, attrs), dma:dma_unmap_page (dma_addr); no area state\"}\n"
    } else {
        printf "\"area_fields\":\"kernel_area_used/index: io_tlb_area.used/.index of each area read at the kretprobe of swiotlb_tbl_map_single; left out for a map with another swiotlb event between its entry and return\","
        printf "\"source\":\"bouncevm images/swiotlb-capture.sh: kprobe p:swiotlb_tbl_map_single(dev=%%di orig=%%si size=%%dx aam=%%cx dir=%%r8 attrs=%%r9), kretprobe $retval, p:__swiotlb_tbl_unmap_single(dev=%%di tlb=%%si size=%%dx dir=%%cx attrs=%%r8)%s%s\"}\n", (backstop ? ", dma:dma_unmap_page for an unmap whose kprobe was skipped" : ""), (dyn ? "; dynamic pools: see bounce/traces/README.md" : "")
    }
    printf "BVM-COUNTS maps=%d failed=%d unmaps=%d unmatched=%d unpaired=%d interleaved=%d pending=%d live=%d lost=%d missed=%d missed_unmap=%d injected=%d recovered=%d unrecovered=%d reused=%d unparsed=%d pool_nslabs=%s pool_nareas=%s", nmap, failed, nunmap, unmatched, unpaired, interleaved, pending, nlive, lost, missed, missed_unmap, injected, recovered, missed - recovered, reused, unparsed, pnslabs, pnareas > "/tmp/counts"
    if (mode == "dma-events") printf " not_bounced=%d outside_default=%d start_source=%s", not_bounced, outside_default, start_source > "/tmp/counts"
    if (dyn) printf " grows=%d workers=%d pool_adds=%d added_nslabs=%d moved=%d racing=%d head_mismatch=%d transients=%d transient_failed=%d transient_search_failed=%d transient_frees=%d in_added=%d in_transient=%d unknown_pool=%d unknown_free=%d unpaired_apool=%d apool_unexpected=%d", ngrow, nworker, nadd, added_nslabs, pool_add_moved, nracing, pool_head_mismatch, ntalloc, ntalloc_failed, tsearch_failed, ntfree, nin_added, nin_trans, unknown_pool, unknown_free, unpaired_apool, apool_args_unexpected > "/tmp/counts"
    printf "\n" > "/tmp/counts"
}' "$TR/trace" > /tmp/trace.jsonl || fail convert-error
cat /tmp/trace.body >> /tmp/trace.jsonl && rm -f /tmp/trace.body
phase convert
[ -w "$TR/kprobe_events" ] && echo > "$TR/kprobe_events" 2>/dev/null
counts="$(sed 's/^BVM-COUNTS //' /tmp/counts)"
if [ "$mode" = kprobes ]; then
    pn="$(echo "$counts" | sed -n 's/.*pool_nslabs=\([0-9]*\).*/\1/p')"
    pa="$(echo "$counts" | sed -n 's/.*pool_nareas=\([0-9]*\).*/\1/p')"
    if [ "$pn" != "$nslabs" ] || [ "$pa" != "$nareas" ]; then
        fail layout-mismatch "$counts debugfs_nslabs=$nslabs dmesg_nareas=$default_nareas pool_nareas=$nareas"
    fi
fi

# ---------------------------------------------------------------- write out
gzip -c /tmp/trace.jsonl > /tmp/trace.jsonl.gz
phase gzip
gz_bytes="$(wc -c < /tmp/trace.jsonl.gz)"
sum="$(sha256sum /tmp/trace.jsonl.gz | cut -d' ' -f1)"
{ printf 'BVMTRACE1 %s %s\n' "$gz_bytes" "$sum"; head -c 4096 /dev/zero; } | head -c 4096 > /tmp/trace.hdr
dd if=/tmp/trace.hdr of="$out" bs=4096 count=1 conv=notrunc,fsync status=none || fail write-error
dd if=/tmp/trace.jsonl.gz of="$out" bs=4096 seek=1 conv=notrunc,fsync status=none || fail write-error
phase write
echo "BVM-RESULT test=$T status=ok $counts gz_bytes=$gz_bytes nslabs=$nslabs nareas=$nareas dynamic=$dyn capture=$mode dev=$dev out=$out"
