#!/usr/bin/env python3
"""Checks a swiotlb kernel trace (bounce/traces/README.md) against Linux 6.12's rules.

Replays every operation through the rules of kernel/dma/swiotlb.c written out in Python, the
static pool and the dynamic pools (CONFIG_SWIOTLB_DYNAMIC, swiotlb-kernel-trace/2) as
bounce/docs/dynamic-swiotlb.md describes them, and compares each map with what the kernel
decided: the bounce address or the failure, the pool it landed in (default, added, transient),
the growth request, each default-pool area's used count and rolling index, and the counters
debugfs shows (io_tlb_nslabs, io_tlb_used, io_tlb_used_hiwater, io_tlb_transient_nslabs).
It also checks the trace itself: every unmap names a live map, every transient pool is freed
by the unmap of its map, every added pool follows a growth request.

    python3 bounce/traces/check_trace.py TRACE.jsonl[.gz] [--show N] [--json]

Prints one JSON object (compared maps, mismatches by kind, pools, counters) and exits 1 if
there was any mismatch or inconsistency, 2 if the trace cannot be read.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from dataclasses import dataclass, field

IO_TLB_SHIFT = 11
IO_TLB_SIZE = 1 << IO_TLB_SHIFT
IO_TLB_SEGSIZE = 128
PAGE_SIZE = 4096
IO_TLB_MIN_SLABS = (1 << 20) >> IO_TLB_SHIFT
MAX_POOL_SLABS = (PAGE_SIZE // IO_TLB_SIZE) << 10  # SLABS_PER_PAGE << MAX_PAGE_ORDER (x86: 10)


def nr_slots(v: int) -> int:
    return -(-v // IO_TLB_SIZE)


def limit_nareas(nareas: int, nslots: int) -> int:
    return nslots // IO_TLB_SEGSIZE if nslots < nareas * IO_TLB_SEGSIZE else nareas


class Pool:
    """struct io_tlb_pool: slots with their free-run counts ("list"), areas with used/index."""

    def __init__(self, start: int, nslabs: int, nareas: int, kind: str):
        self.start, self.nslabs, self.nareas, self.kind = start, nslabs, nareas, kind
        self.end = start + nslabs * IO_TLB_SIZE
        self.area_nslabs = nslabs // nareas
        self.used = [0] * nareas
        self.index = [0] * nareas
        self.list = [min(IO_TLB_SEGSIZE - (i % IO_TLB_SEGSIZE), nslabs - i) for i in range(nslabs)]
        self.alloc_size = [0] * nslabs
        self.pad = [0] * nslabs

    def wrap(self, index: int) -> int:
        return 0 if index >= self.area_nslabs else index

    def search_area(self, area: int, orig: int, alloc_size: int, alloc_align_mask: int,
                    min_align_mask: int, boundary_mask: int) -> int:
        """swiotlb_search_pool_area: index of the first slot, or -1."""
        tbl_dma_addr = self.start & boundary_mask
        max_slots = (boundary_mask >> IO_TLB_SHIFT) + 1
        iotlb_align_mask = min_align_mask
        nslots = nr_slots(alloc_size)
        offset = orig & min_align_mask & (IO_TLB_SIZE - 1)
        if not alloc_align_mask and not iotlb_align_mask and alloc_size >= PAGE_SIZE:
            alloc_align_mask = PAGE_SIZE - 1
        alloc_align_mask |= IO_TLB_SIZE - 1
        iotlb_align_mask &= ~alloc_align_mask
        stride = (max(alloc_align_mask, iotlb_align_mask) >> IO_TLB_SHIFT) + 1
        if nslots > self.area_nslabs - self.used[area]:
            return -1
        slot_base = area * self.area_nslabs
        index = self.index[area]
        checked = 0
        while checked < self.area_nslabs:
            slot_index = slot_base + index
            tlb_addr = tbl_dma_addr + (slot_index << IO_TLB_SHIFT)
            if (tlb_addr & alloc_align_mask) or (
                    orig and (tlb_addr & iotlb_align_mask) != (orig & iotlb_align_mask)):
                index = self.wrap(index + 1)
                checked += 1
                continue
            shift = (nr_slots(tbl_dma_addr) + slot_index) & (max_slots - 1)
            if shift + nslots <= max_slots and self.list[slot_index] >= nslots:
                for i in range(slot_index, slot_index + nslots):
                    self.list[i] = 0
                    self.alloc_size[i] = alloc_size - (offset + ((i - slot_index) << IO_TLB_SHIFT))
                count = 0
                i = slot_index - 1
                while i >= 0 and i % IO_TLB_SEGSIZE != IO_TLB_SEGSIZE - 1 and self.list[i]:
                    count += 1
                    self.list[i] = count
                    i -= 1
                self.index[area] = self.wrap(index + nslots)
                self.used[area] += nslots
                return slot_index
            index = self.wrap(index + stride)
            checked += stride
        return -1

    def release(self, tlb_addr: int, min_align_mask: int) -> int:
        """swiotlb_release_slots: returns the slots freed."""
        offset = tlb_addr & min_align_mask & (IO_TLB_SIZE - 1)
        index = (tlb_addr - offset - self.start) >> IO_TLB_SHIFT
        index -= self.pad[index]
        nslots = nr_slots(self.alloc_size[index] + offset)
        aindex = index // self.area_nslabs
        seg_end = (index + 1 + IO_TLB_SEGSIZE - 1) // IO_TLB_SEGSIZE * IO_TLB_SEGSIZE
        count = self.list[index + nslots] if index + nslots < seg_end else 0
        for i in range(index + nslots - 1, index - 1, -1):
            count += 1
            self.list[i] = count
            self.alloc_size[i] = 0
            self.pad[i] = 0
        i = index - 1
        while i >= 0 and i % IO_TLB_SEGSIZE != IO_TLB_SEGSIZE - 1 and self.list[i]:
            count += 1
            self.list[i] = count
            i -= 1
        self.used[aindex] -= nslots
        return nslots


@dataclass
class Live:
    pool: Pool
    tlb_addr: int
    min_align_mask: int


@dataclass
class Checker:
    header: dict
    show: int = 20
    mismatches: dict = field(default_factory=dict)
    examples: list = field(default_factory=list)
    compared: int = 0
    maps: int = 0
    failed: int = 0

    def __post_init__(self) -> None:
        h = self.header
        self.version = int(str(h.get("format", "swiotlb-kernel-trace/1")).rsplit("/", 1)[-1])
        self.dynamic = self.version >= 2
        self.default = Pool(h["start"], h["nslabs"], h["nareas"], "default")
        for a, x in enumerate(h.get("area_index_at_start") or []):
            self.default.index[a] = x
        if any(h.get("area_used_at_start") or []):
            self.mismatch("trace", "area_used_at_start is not all 0: live mappings the trace "
                          "does not describe")
        self.min_align_mask = h.get("min_align_mask", 0)
        self.boundary_mask = h.get("seg_boundary_mask", 0xFFFFFFFF)
        d = h.get("dynamic") or {}
        self.default_nareas = d.get("default_nareas", h["nareas"])
        self.default_nslabs = d.get("default_nslabs", h["nslabs"])
        self.can_grow = bool(d.get("can_grow", 0))
        self.pools = [self.default]  # mem->pools, newest first
        self.transient: dict[int, Pool] = {}
        self.live: dict[int, Live] = {}
        self.pending_transient: dict[int, dict] = {}
        before = h.get("debugfs_before") or {}
        self.total_used = 0
        hw = before.get("io_tlb_used_hiwater")
        self.hiwater = int(hw) if hw not in (None, "na") else 0
        self.nslabs = h["nslabs"]
        self.transient_nslabs = 0
        # growth requests (schedule_work of dyn_alloc) as (map entry ts, map return ts), and the
        # start of the last worker run: the work's PENDING bit is cleared when a run starts, so
        # each run answers a request made after the previous run started
        self.grow_requests: list[tuple[float, float]] = []
        self.last_worker_ts = float("-inf")
        self.cur_ts = self.cur_ret_ts = 0.0
        self.freed_transient = None
        self.counts = {"pool_add": 0, "transient_alloc": 0, "transient_free": 0,
                       "grow_requests": 0, "maps_in_added": 0, "maps_in_transient": 0}

    def mismatch(self, kind: str, what: str) -> None:
        self.mismatches[kind] = self.mismatches.get(kind, 0) + 1
        if len(self.examples) < self.show:
            self.examples.append(f"{kind}: {what}")

    # ------------------------------------------------------------------ the allocator
    def used_inc(self, n: int) -> None:
        self.total_used += n
        self.hiwater = max(self.hiwater, self.total_used)

    def find_slots(self, cpu: int, orig: int, alloc_size: int, aam: int, mam: int, bmask: int,
                   map_id: int, want_grow: bool) -> tuple[Pool | None, int]:
        if not self.dynamic:
            pool = self.default
            start = i = cpu & (pool.nareas - 1)
            while True:
                idx = pool.search_area(i, orig, alloc_size, aam, mam, bmask)
                if idx >= 0:
                    self.used_inc(nr_slots(alloc_size))
                    return pool, idx
                i = 0 if i + 1 >= pool.nareas else i + 1
                if i == start:
                    return None, -1
        if alloc_size > IO_TLB_SEGSIZE * IO_TLB_SIZE:
            return None, -1
        for off in range(self.default_nareas):
            for pool in self.pools:
                if off >= pool.nareas:
                    continue
                idx = pool.search_area((cpu + off) & (pool.nareas - 1), orig, alloc_size, aam,
                                       mam, bmask)
                if idx >= 0:
                    self.used_inc(nr_slots(alloc_size))
                    return pool, idx
        if not self.can_grow:
            return None, -1
        self.grow_requests.append((self.cur_ts, self.cur_ret_ts))
        self.counts["grow_requests"] += 1
        if not want_grow:
            self.mismatch("grow", f"map {map_id}: the model requests growth, the kernel did not")
        t = self.pending_transient.pop(map_id, None)
        if t is None:
            self.mismatch("transient", f"map {map_id}: the model needs a transient pool, the "
                          "trace has no transient_alloc for it")
            return None, -1
        if t.get("failed"):
            return None, -1
        nslabs = nr_slots(alloc_size)
        if t["nslabs"] != nslabs or t.get("nareas", 1) != 1:
            self.mismatch("transient", f"map {map_id}: transient pool of {t['nslabs']} slots "
                          f"x {t.get('nareas')} areas, the model sizes it {nslabs} x 1")
        pool = Pool(t["start"], t["nslabs"], 1, "transient")
        idx = pool.search_area(0, orig, alloc_size, aam, mam, bmask)
        if (idx < 0) != bool(t.get("kernel_search_failed")):
            self.mismatch("transient", f"map {map_id}: a slot in the fresh transient pool: "
                          f"kernel {not t.get('kernel_search_failed')}, model {idx >= 0}")
        if idx < 0:
            return None, -1
        self.used_inc(nr_slots(alloc_size))
        self.transient[pool.start] = pool
        self.transient_nslabs += pool.nslabs
        return pool, idx

    # ------------------------------------------------------------------ operations
    def op_map(self, m: dict) -> None:
        self.maps += 1
        mid = m["id"]
        orig, size, cpu = m["orig"], m["size"], m.get("cpu", m.get("worker", 0))
        aam = m.get("alloc_align_mask", 0)
        mam = m.get("min_align_mask", self.min_align_mask) or 0
        bmask = m.get("seg_boundary_mask", self.boundary_mask)
        offset = orig & mam & (aam | (IO_TLB_SIZE - 1))
        alloc = (size + offset + aam) & ~aam
        self.cur_ts = m.get("ts", 0)
        self.cur_ret_ts = m.get("ret_ts", self.cur_ts)
        requests = len(self.grow_requests)
        pool, idx = self.find_slots(cpu, orig, alloc, aam, mam, bmask, mid,
                                    bool(m.get("kernel_grow")))
        if mid in self.pending_transient:
            self.mismatch("transient", f"map {mid}: the kernel allocated a transient pool, the "
                          "model served the map from the pools")
            self.pending_transient.pop(mid)
        addr = None
        if pool is not None:
            pad = offset >> IO_TLB_SHIFT
            idx += pad
            pool.pad[idx] = pad
            addr = pool.start + (idx << IO_TLB_SHIFT) + (offset & (IO_TLB_SIZE - 1))
            self.live[mid] = Live(pool, addr, mam)
        if self.dynamic and m.get("kernel_grow") and requests == len(self.grow_requests):
            self.mismatch("grow", f"map {mid}: the kernel requested growth, the model did not")
        if "kernel_tlb_addr" not in m and "kernel_error" not in m:
            return
        self.compared += 1
        kaddr = m.get("kernel_tlb_addr")
        if kaddr is None:
            self.failed += 1
        if kaddr != addr:
            self.mismatch("address", f"map {mid} (size {size}, cpu {cpu}): kernel {kaddr}, "
                          f"model {addr}")
        if self.dynamic and addr is not None:
            kind = m.get("kernel_pool_kind")
            if kind != pool.kind or m.get("kernel_pool") != pool.start:
                self.mismatch("pool", f"map {mid}: kernel pool {kind} {m.get('kernel_pool')}, "
                              f"model {pool.kind} {pool.start}")
            if pool.kind == "added":
                self.counts["maps_in_added"] += 1
            elif pool.kind == "transient":
                self.counts["maps_in_transient"] += 1
        if "kernel_area_used" in m:
            if m["kernel_area_used"] != self.default.used or \
                    m["kernel_area_index"] != self.default.index:
                self.mismatch("area", f"map {mid}: kernel used {m['kernel_area_used']} index "
                              f"{m['kernel_area_index']}, model {self.default.used} "
                              f"{self.default.index}")
        if "kernel_used" in m:
            got = (m["kernel_nslabs"], m["kernel_used"], m["kernel_hiwater"],
                   m["kernel_transient_nslabs"])
            want = (self.nslabs, self.total_used, self.hiwater, self.transient_nslabs)
            if got != want:
                self.mismatch("counters", f"map {mid}: kernel nslabs/used/hiwater/transient "
                              f"{got}, model {want}")

    def op_unmap(self, u: dict) -> None:
        live = self.live.pop(u["id"], None)
        if live is None:
            self.mismatch("trace", f"unmap of {u['id']}, which is not live")
            return
        if u.get("tlb_addr", live.tlb_addr) != live.tlb_addr:
            self.mismatch("trace", f"unmap of {u['id']} at {u['tlb_addr']}, mapped at "
                          f"{live.tlb_addr}")
        if live.pool.kind == "transient":
            # swiotlb_del_transient: the whole pool goes
            self.total_used -= live.pool.nslabs
            self.transient_nslabs -= live.pool.nslabs
            del self.transient[live.pool.start]
            self.freed_transient = live.pool.start
        else:
            self.total_used -= live.pool.release(live.tlb_addr, live.min_align_mask)
            self.freed_transient = None

    def op_transient_alloc(self, t: dict) -> None:
        self.counts["transient_alloc"] += 1
        self.pending_transient[t["id"]] = t

    def op_transient_free(self, t: dict) -> None:
        self.counts["transient_free"] += 1
        if t.get("search_failed"):
            # swiotlb_find_slots freed the pool at once: an input of the map, like its
            # transient_alloc, which it follows
            pending = self.pending_transient.get(t["id"])
            if pending is None or pending.get("start") != t["start"]:
                self.mismatch("trace", f"transient_free (search failed) of map {t['id']} "
                              "without its transient_alloc")
            else:
                pending["kernel_search_failed"] = True
            return
        if self.freed_transient != t["start"]:
            self.mismatch("transient", f"transient pool {t['start']} freed by the kernel at "
                          f"the unmap of map {t['id']}, not by the model")

    def op_pool_add(self, p: dict) -> None:
        self.counts["pool_add"] += 1
        start = p.get("worker_ts", float("inf"))
        if not any(ret > self.last_worker_ts and ts < start for ts, ret in self.grow_requests):
            self.mismatch("grow", f"pool {p['start']} added by a worker run that no growth "
                          "request since the previous run asked for")
        self.last_worker_ts = start
        want = min(self.default_nslabs, MAX_POOL_SLABS)
        n, a = p["nslabs"], p["nareas"]
        ok_size = n == want or (IO_TLB_MIN_SLABS <= n < want and n % IO_TLB_SEGSIZE == 0)
        if not ok_size or a != limit_nareas(self.default_nareas, n):
            self.mismatch("pool", f"pool {p['start']}: {n} slots x {a} areas; the worker asks "
                          f"for {want} (halving to {IO_TLB_MIN_SLABS}) x limit_nareas"
                          f"({self.default_nareas}, nslabs)")
        self.pools.insert(0, Pool(p["start"], n, a, "added"))
        self.nslabs += n

    def run(self, ops) -> dict:
        handlers = {"map": self.op_map, "unmap": self.op_unmap, "pool_add": self.op_pool_add,
                    "transient_alloc": self.op_transient_alloc,
                    "transient_free": self.op_transient_free}
        for o in ops:
            h = handlers.get(o.get("op"))
            if h is None:
                self.mismatch("trace", f"unknown op {o.get('op')!r}")
            else:
                h(o)
        if self.pending_transient:
            self.mismatch("transient", f"transient_alloc without its map: {sorted(self.pending_transient)}")
        after = self.header.get("debugfs_after") or {}
        end = {"io_tlb_used": self.total_used, "io_tlb_nslabs": self.nslabs,
               "io_tlb_transient_nslabs": self.transient_nslabs}
        for k, v in end.items():
            if k in after and after[k] != v and not (k == "io_tlb_used" and self.live):
                self.mismatch("counters", f"debugfs_after.{k}={after[k]}, model {v}")
        return {"format": self.header.get("format"), "compared": self.compared,
                "maps": self.maps, "kernel_failures": self.failed,
                "mismatches": sum(self.mismatches.values()), "by_kind": self.mismatches,
                "pools": [{"start": p.start, "nslabs": p.nslabs, "nareas": p.nareas,
                           "kind": p.kind} for p in self.pools],
                "counters": end | {"io_tlb_used_hiwater": self.hiwater},
                "live_at_end": len(self.live), **self.counts, "examples": self.examples}


def read_ops(path: str):
    with open(path, "rb") as f:
        magic = f.read(2)
    opener = gzip.open if magic == b"\x1f\x8b" else open
    with opener(path, "rt") as f:
        for line in f:
            line = line.strip()
            if line:
                yield json.loads(line)


def check(path: str, show: int = 20) -> dict:
    ops = read_ops(path)
    header = next(ops)
    if header.get("op") != "header":
        raise ValueError("the first line is not a header")
    return Checker(header, show).run(ops)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--show", type=int, default=20, help="mismatches to print (default 20)")
    args = ap.parse_args()
    try:
        r = check(args.trace, args.show)
    except (OSError, ValueError, KeyError, StopIteration) as e:
        print(f"check_trace: cannot read {args.trace}: {e}", file=sys.stderr)
        return 2
    for e in r["examples"]:
        print(e, file=sys.stderr)
    print(json.dumps(r))
    return 1 if r["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
