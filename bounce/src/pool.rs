//! The bounce pool: slot metadata, the copy rules, map/unmap/sync.
//!
//! This follows Linux `swiotlb_tbl_map_single`, `swiotlb_bounce`, `swiotlb_release_slots`,
//! `__swiotlb_tbl_unmap_single` and the two sync calls, with checks added where Linux trusts its
//! caller: an unmap of an address that is not a live mapping is refused instead of corrupting the
//! free lists.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use vm_memory::{MmapRegion, VolatileMemory, VolatileSlice};

use crate::alloc::{self, SlotAllocator, SlotRequest};
use crate::dynamic::{Dynamic, DynamicPools, Found, Placed, PoolInfo, PoolKind, PoolPages};
use crate::error::{Error, Result};
use crate::geometry::{Geometry, PoolConfig, SizeLimit};
use crate::orig::OrigMemory;
use crate::stats::{Counters, PoolStats, ShardRef, Stat, TimedOp, Timing};
use crate::types::{CopyOnMap, Direction, DmaAttrs, MapRequest, PoolMode, SyncFor};

mod batch;

pub use batch::PoolBatch;

/// The pool's internal result: the error boxed, so a result fits in two registers and is never
/// moved through the stack (a 40-byte `Result<(), Error>` copied between stack slots after
/// partial stores stalled store forwarding on every unmap). Errors are rare; the public
/// functions unbox them.
type Fast<T> = std::result::Result<T, Box<Error>>;

/// `Err(e)`, boxed.
#[cold]
fn fail<T>(e: Error) -> Fast<T> {
    Err(Box::new(e))
}

/// Marks "no original address" in slot metadata (Linux `INVALID_PHYS_ADDR`).
const INVALID: u64 = u64::MAX;

/// Per-slot metadata (Linux `struct io_tlb_slot`, minus `list`, which belongs to allocators).
///
/// A slot's metadata is written only by the map that owns the slot, before the device address is
/// handed out, and reset by the unmap that releases it, before the slot returns to the
/// allocator; the allocator's lock (or atomic) orders those writes against the next owner.
///
/// 32 bytes, aligned to 32 ([`SlotTable`] puts two to a cache line).
#[derive(Debug)]
#[repr(align(32))]
struct SlotMeta {
    /// Original address this slot shadows, or `INVALID`. Slot `i` of a mapping records
    /// `orig + i * slot_size`, so a sync from the middle of a mapping finds its source.
    orig: AtomicU64,
    /// Bytes from this slot's start (less the in-slot offset) to the end of the allocation.
    alloc_size: AtomicU64,
    /// Padding slots before this one; valid only in the first non-padding slot.
    pad_slots: AtomicU32,
    /// In-slot offset of the mapping's data (`orig & min_align_mask & (slot_size - 1)`),
    /// kept so sync and unmap need not be told the device's `min_align_mask`.
    offset: AtomicU32,
    /// Non-zero only in the first non-padding slot of a live mapping: the in-slot offset of
    /// the device address that map returned, plus one. Unmap claims it with a compare-exchange,
    /// so an address is released at most once.
    head: AtomicU32,
}

const _: () = assert!(std::mem::size_of::<SlotMeta>() == 32);

/// Bytes of a cache line, as far as [`SlotTable`] is concerned.
const CACHE_LINE: usize = 64;

/// Every slot's [`SlotMeta`], laid out so that each even-odd pair of slots fills one cache line
/// of its own: a 4 KiB mapping of 2 KiB slots (two slots, page aligned) touches one line, and
/// two threads never write the same line for mappings of two slots or more.
///
/// The heap gives a `Box<[SlotMeta]>` only the type's 32-byte alignment; one spare entry and a
/// skew of 0 or 1 entries make slot 0 start a line. Without it, the table started 16 bytes into
/// a line, every 4 KiB mapping's metadata straddled two lines shared with its neighbours, and
/// two threads whose runs the allocator interleaved (iova-rcache refilling from one tree) wrote
/// each other's lines on every map and unmap: 15 ns more per pair, only in the runs where the
/// runs happened to interleave (docs/studies/allocators-host.md).
#[derive(Debug)]
struct SlotTable {
    entries: Box<[SlotMeta]>,
    /// Entries skipped at the front (0 or 1) so that slot 0 starts a cache line.
    skew: usize,
    /// Slots.
    len: usize,
}

impl SlotTable {
    fn new(len: usize) -> Self {
        let entries: Box<[SlotMeta]> = (0..=len).map(|_| SlotMeta::new()).collect();
        // The address only, to pick the skew: entries are 32-byte aligned, so slot 0 is
        // line aligned at entry 0 or entry 1.
        let skew = usize::from(entries.as_ptr() as usize % CACHE_LINE != 0);
        Self { entries, skew, len }
    }

    /// Every slot's metadata, slot 0 first.
    #[inline(always)]
    fn slots(&self) -> &[SlotMeta] {
        &self.entries[self.skew..self.skew + self.len]
    }

    /// Slot `index`'s metadata.
    #[inline(always)]
    fn slot(&self, index: usize) -> &SlotMeta {
        &self.slots()[index]
    }

    /// The metadata of slots `index..index + n`.
    #[inline(always)]
    fn run(&self, index: usize, n: usize) -> &[SlotMeta] {
        &self.slots()[index..index + n]
    }
}

impl SlotMeta {
    fn new() -> Self {
        Self {
            orig: AtomicU64::new(INVALID),
            alloc_size: AtomicU64::new(0),
            pad_slots: AtomicU32::new(0),
            offset: AtomicU32::new(0),
            head: AtomicU32::new(0),
        }
    }
}

/// A live mapping: what [`BouncePool::map`] returns and [`BouncePool::unmap`] takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mapping {
    /// Device address of the first byte.
    pub dev_addr: u64,
    /// Original address.
    pub orig: u64,
    /// Mapping size in bytes.
    pub size: usize,
    /// Direction.
    pub dir: Direction,
    /// Attributes.
    pub attrs: DmaAttrs,
    /// First slot of the allocation (padding included), for reports.
    pub slot: usize,
    /// Slots of the allocation.
    pub nslots: usize,
}

/// What [`BouncePool::bounce`] needs of the slot a copy starts in, when the caller has read it
/// already (map and unmap know their head slot).
#[derive(Clone, Copy, Debug)]
struct SlotView {
    /// The slot's original address (`SlotMeta::orig`).
    orig: u64,
    /// `SlotMeta::alloc_size`.
    alloc_size: u64,
    /// `SlotMeta::offset`.
    offset: u32,
}

/// Where a copy happens: the pool its device address is in, and the metadata of the slot the
/// address falls in when the caller has read it already (`None`: the copy reads it).
#[derive(Clone, Copy, Debug)]
struct CopyAt<'a> {
    tlb: &'a TlbPool,
    view: Option<SlotView>,
}

impl<'a> CopyAt<'a> {
    /// A copy in `tlb` that reads the slot's metadata itself (a sync).
    fn read(tlb: &'a TlbPool) -> Self {
        Self { tlb, view: None }
    }
}

/// What an unmap was asked ([`BouncePool::unmap_single`]'s arguments).
#[derive(Clone, Copy, Debug)]
struct UnmapArgs {
    addr: u64,
    size: usize,
    dir: Direction,
    attrs: DmaAttrs,
    worker: usize,
}

/// Where a mapping's data sits in its allocation.
#[derive(Clone, Copy, Debug)]
struct Layout {
    /// Bytes from the allocation's start to the data (padding slots and in-slot offset).
    offset: u64,
    /// Allocation size in bytes, padding and alignment included.
    alloc_size: u64,
}

/// One pool of slots (Linux `struct io_tlb_pool`): its geometry (device address, slots,
/// areas), the per-slot metadata and the allocator of its free slots. A static
/// [`BouncePool`] has one; a dynamic one has its default pool and the pools it adds
/// ([`crate::dynamic`]). The memory behind its device addresses is the [`BouncePool`]'s.
#[derive(Debug)]
pub(crate) struct TlbPool {
    pub geom: Geometry,
    meta: SlotTable,
    pub alloc: Arc<dyn SlotAllocator>,
}

impl TlbPool {
    /// A pool of `geom` with the `areas` allocator (Linux's); `single_run`: one area of
    /// any length up to a segment (a transient pool, sized to its one mapping).
    ///
    /// # Errors
    /// [`Error::Config`] for a geometry the allocator cannot serve.
    pub fn new(geom: Geometry, single_run: bool) -> Result<Self> {
        let alloc: Arc<dyn SlotAllocator> = if single_run {
            Arc::new(alloc::single_area(&geom)?)
        } else {
            alloc::build(crate::types::AllocatorKind::Areas, &geom)?
        };
        Ok(Self::with_allocator(geom, alloc))
    }

    fn with_allocator(geom: Geometry, alloc: Arc<dyn SlotAllocator>) -> Self {
        Self {
            meta: SlotTable::new(geom.nslabs),
            geom,
            alloc,
        }
    }

    /// True when device address `addr` is one of this pool's slots.
    #[inline]
    pub fn holds(&self, addr: u64) -> bool {
        addr >= self.geom.base && addr - self.geom.base < self.geom.bytes() as u64
    }

    /// Where this pool is.
    pub fn info(&self, kind: PoolKind) -> PoolInfo {
        PoolInfo {
            start: self.geom.base,
            nslabs: self.geom.nslabs,
            nareas: self.geom.nareas,
            kind,
        }
    }
}

/// A pool of bounce slots in one host mapping, usable from any thread.
///
/// Static (the default): one [`TlbPool`] filling the mapping. Dynamic
/// ([`PoolConfig::dynamic`]): the mapping is a window holding the default pool and the pools
/// [`crate::dynamic`] adds and frees.
#[derive(Debug)]
pub struct BouncePool {
    /// The default pool (the only one of a static pool).
    tlb: TlbPool,
    /// Device address of the first byte of `memory`.
    window_base: u64,
    /// The memory behind every device address of the pool.
    memory: MmapRegion,
    /// Added and transient pools, with their growth worker; `None` for a static pool.
    dynamic: Option<Box<Dynamic>>,
    copy_on_map: CopyOnMap,
    size_limit: SizeLimit,
    counters: Counters,
    /// Time accounting; its hooks are the three wrappers `map`, `bounce`, `unmap_single`.
    timing: Timing,
    created: Instant,
    /// Milliseconds since `created` of the last "full" warning (rate limit).
    last_full_warn_ms: AtomicU64,
    /// Set once the "copy clamped" warning was logged.
    clamp_warned: AtomicU32,
}

impl BouncePool {
    /// Builds a pool: resolves the geometry, maps the memory (zeroed), builds the allocator;
    /// for a dynamic pool also its window and, with memory of its own, its growth worker.
    ///
    /// # Errors
    /// [`Error::Config`] for a configuration that cannot be built, [`Error::PoolMemory`] when
    /// the memory cannot be mapped.
    pub fn new(config: &PoolConfig) -> Result<Self> {
        let geom = config.geometry()?;
        let Some(dynamic) = &config.dynamic else {
            let alloc = alloc::build(config.allocator, &geom)?;
            let mut pool = Self::with_allocator(geom, alloc, config.copy_on_map)?;
            pool.size_limit = config.size_limit;
            return Ok(pool);
        };
        if config.allocator != crate::types::AllocatorKind::Areas {
            return Err(Error::Config(format!(
                "dynamic pools search areas as Linux does: alloc=areas, not {}",
                config.allocator
            )));
        }
        let window = match dynamic.pages {
            PoolPages::Host { slots } | PoolPages::HostStepped { slots } => {
                let bytes = (slots as u64)
                    .checked_shl(geom.slot_shift)
                    .filter(|b| b >> geom.slot_shift == slots as u64)
                    .ok_or_else(|| Error::Config("window size overflows".into()))?;
                (geom.base, bytes)
            }
            PoolPages::Given {
                window_base,
                window_bytes,
            } => (window_base, window_bytes),
        };
        let pools = DynamicPools::new(&geom, config.requested_nareas()?, dynamic, window)?;
        let memory = Self::map_memory(window.1)?;
        let tlb = TlbPool::new(geom, false)?;
        let mut pool = Self::assemble(tlb, window.0, memory, config.copy_on_map);
        // Inside the window: DynamicPools::new checked it.
        let default_off = usize::try_from(geom.base - window.0)
            .map_err(|_| Error::Config("default pool offset overflows".into()))?;
        pool.touch(default_off, geom.bytes());
        pool.size_limit = config.size_limit;
        pool.dynamic = Some(Box::new(Dynamic::new(pools)?));
        Ok(pool)
    }

    /// Builds a pool around an allocator made elsewhere (for experiments and tests).
    ///
    /// # Errors
    /// As [`BouncePool::new`].
    pub fn with_allocator(
        geom: Geometry,
        alloc: Arc<dyn SlotAllocator>,
        copy_on_map: Option<CopyOnMap>,
    ) -> Result<Self> {
        let bytes = geom.bytes();
        let memory = Self::map_memory(bytes as u64)?;
        let pool = Self::assemble(
            TlbPool::with_allocator(geom, alloc),
            geom.base,
            memory,
            copy_on_map,
        );
        pool.touch(0, bytes);
        Ok(pool)
    }

    /// Maps `bytes` of anonymous memory (reserved lazily: a dynamic pool's window is touched
    /// only where pools are).
    fn map_memory(bytes: u64) -> Result<MmapRegion> {
        let len = usize::try_from(bytes).map_err(|_| Error::PoolMemory {
            bytes: usize::MAX,
            reason: "larger than the address space".into(),
        })?;
        MmapRegion::new(len).map_err(|e| Error::PoolMemory {
            bytes: len,
            reason: e.to_string(),
        })
    }

    fn assemble(
        tlb: TlbPool,
        window_base: u64,
        memory: MmapRegion,
        copy_on_map: Option<CopyOnMap>,
    ) -> Self {
        Self {
            copy_on_map: copy_on_map.unwrap_or(tlb.geom.mode.default_copy_on_map()),
            tlb,
            window_base,
            memory,
            dynamic: None,
            size_limit: SizeLimit::MaxMappingSize,
            counters: Counters::default(),
            timing: Timing::default(),
            created: Instant::now(),
            last_full_warn_ms: AtomicU64::new(u64::MAX),
            clamp_warned: AtomicU32::new(0),
        }
    }

    /// Writes zeros over `bytes` of the memory from offset `off`: Linux's pool is resident
    /// memory; without this the first pass of a rolling index over fresh anonymous memory pays
    /// a page fault per 4 KiB and skews every measurement taken during it.
    fn touch(&self, off: usize, bytes: usize) {
        let zeros = [0u8; 65536];
        let whole = self.memory.as_volatile_slice();
        let mut done = 0;
        while done < bytes {
            let n = (bytes - done).min(zeros.len());
            if let Ok(part) = whole.subslice(off + done, n) {
                part.copy_from(&zeros[..n]);
            }
            done += n;
        }
    }

    /// The dynamic pools, for a pool built with [`PoolConfig::dynamic`].
    pub fn dynamic(&self) -> Option<&DynamicPools> {
        self.dynamic.as_deref().map(|d| &*d.pools)
    }

    /// The pool device address `addr` is in: the default pool, or for a dynamic pool an added
    /// or live transient one. `None` when it is in none.
    pub fn pool_of(&self, addr: u64) -> Option<PoolInfo> {
        match self.dynamic() {
            None => self
                .tlb
                .holds(addr)
                .then(|| self.tlb.info(PoolKind::Default)),
            Some(d) => d.pool_of(&self.tlb, addr).map(|p| match p {
                Found::Listed(t) if std::ptr::eq(t, &self.tlb) => t.info(PoolKind::Default),
                Found::Listed(t) => t.info(PoolKind::Added),
                Found::Transient(t) => t.info(PoolKind::Transient),
            }),
        }
    }

    /// The pool's geometry.
    pub fn geometry(&self) -> &Geometry {
        &self.tlb.geom
    }

    /// The pool's allocator.
    pub fn allocator(&self) -> &Arc<dyn SlotAllocator> {
        &self.tlb.alloc
    }

    /// The copy rule on map.
    pub fn copy_on_map(&self) -> CopyOnMap {
        self.copy_on_map
    }

    /// Which mapping sizes map accepts.
    pub fn size_limit(&self) -> SizeLimit {
        self.size_limit
    }

    /// Sets which mapping sizes map accepts (for pools built with
    /// [`BouncePool::with_allocator`]).
    pub fn set_size_limit(&mut self, limit: SizeLimit) {
        self.size_limit = limit;
    }

    /// The largest mapping this pool can ever satisfy for a device with `min_align_mask`
    /// (Linux `swiotlb_max_mapping_size`: a segment, less the mask rounded up to a slot).
    #[inline]
    pub fn max_mapping_size(&self, min_align_mask: u64) -> usize {
        // The mask rounded up to a slot, with a shift (this is on every map).
        let min_align = self
            .tlb
            .geom
            .nr_slots(min_align_mask)
            .saturating_mul(self.tlb.geom.slot_size());
        let seg = (self.tlb.geom.segsize as u64) << self.tlb.geom.slot_shift;
        usize::try_from(seg.saturating_sub(min_align)).unwrap_or(usize::MAX)
    }

    /// True when `addr..addr + len` lies inside the pool's device address range (a dynamic
    /// pool's: its whole window).
    #[inline]
    pub fn contains(&self, addr: u64, len: usize) -> bool {
        addr >= self.window_base
            && (addr - self.window_base)
                .checked_add(len as u64)
                .is_some_and(|end| end <= self.memory.size() as u64)
    }

    /// The pool memory behind device addresses `addr..addr + len`: what a device reads and
    /// writes.
    ///
    /// # Errors
    /// [`Error::OutOfPool`] when the range is not inside the pool.
    pub fn device_slice(&self, addr: u64, len: usize) -> Result<VolatileSlice<'_>> {
        if !self.contains(addr, len) {
            return Err(Error::OutOfPool { addr, len });
        }
        let off = (addr - self.window_base) as usize;
        self.memory
            .get_slice(off, len)
            .map_err(|_| Error::OutOfPool { addr, len })
    }

    /// The host memory of the whole pool: start address and length. It stays mapped, at that
    /// address, as long as the pool lives; an I/O engine registers it once with the kernel
    /// (io_uring fixed buffers), as a real device's DMA window is set up once, so the data
    /// of bounced I/O needs no page pinning per request.
    pub fn host_memory(&self) -> (*mut u8, usize) {
        (self.memory.as_ptr(), self.memory.size())
    }

    /// Linux's masks are always 2^k - 1; a mask with holes has no meaning for placement. Zero
    /// for such a mask.
    #[inline]
    fn holes(mask: u64) -> u64 {
        mask & mask.wrapping_add(1)
    }

    /// The error for a request with a mask that has holes (the first one, in this order).
    #[cold]
    fn mask_error(req: &MapRequest) -> Error {
        let reason = if Self::holes(req.min_align_mask) != 0 {
            "min_align_mask is not of the form 2^k-1"
        } else if Self::holes(req.alloc_align_mask) != 0 {
            "alloc_align_mask is not of the form 2^k-1"
        } else {
            "segment boundary mask is not of the form 2^k-1"
        };
        Error::BadAlignment { reason }
    }

    /// Maps an original buffer: allocates slots, records the metadata, copies in as the rules
    /// say, and returns the mapping (Linux `swiotlb_tbl_map_single`).
    ///
    /// # Errors
    /// [`Error::ZeroLength`], [`Error::Overflow`], [`Error::BadAlignment`] (masks not of the
    /// form `2^k - 1`), [`Error::TooLarge`], [`Error::OrigAccess`] (the original range is not
    /// accessible), [`Error::PoolFull`] (logged, rate-limited, unless `no_warn`).
    #[inline]
    pub fn map<M: OrigMemory + ?Sized>(&self, mem: &M, req: &MapRequest) -> Result<Mapping> {
        self.map_timed(mem, req, true).map_err(|e| *e)
    }

    /// As [`BouncePool::map`] for [`crate::Dma`], which has checked the original range
    /// already (the path's one check): the range is not checked again. An original that is
    /// not accessible after all still fails the copy with [`Error::OrigAccess`] and releases
    /// the slots.
    pub(crate) fn map_prevalidated<M: OrigMemory + ?Sized>(
        &self,
        mem: &M,
        req: &MapRequest,
    ) -> Result<Mapping> {
        self.map_timed(mem, req, false).map_err(|e| *e)
    }

    #[inline(always)]
    fn map_timed<M: OrigMemory + ?Sized>(
        &self,
        mem: &M,
        req: &MapRequest,
        check_orig: bool,
    ) -> Fast<Mapping> {
        self.timed(TimedOp::Map, req.dir, || {
            let layout = self.checked_layout(mem, req, check_orig)?;
            let sreq = self.request_of(req, &layout);
            if let Some(d) = &self.dynamic {
                return self.map_dynamic(&d.pools, mem, req, &sreq, &layout);
            }
            let index = self.claim(&sreq, layout.alloc_size, req.attrs.no_warn)?;
            self.fill(&self.tlb, index, mem, req, &sreq, &layout)
        })
    }

    /// Runs `call` as one call of `op` in `dir` under the pool's time accounting.
    #[inline(always)]
    pub(crate) fn timed<T>(&self, op: TimedOp, dir: Direction, call: impl FnOnce() -> T) -> T {
        let t0 = self.timing.start(op);
        let r = call();
        self.timing.record(op, dir, t0, &self.counters);
        r
    }

    // map_timed's arguments because it is map_timed's (and PoolBatch's) first step.
    /// Every check of a map before it allocates: the request's size and masks, and (when
    /// `check_orig`) the whole original range, before anything is allocated or copied.
    #[inline(always)]
    fn checked_layout<M: OrigMemory + ?Sized>(
        &self,
        mem: &M,
        req: &MapRequest,
        check_orig: bool,
    ) -> Fast<Layout> {
        let layout = self.layout(req)?;
        if check_orig && !mem.check(req.orig, req.size, req.dir.device_writes()) {
            return fail(Error::OrigAccess {
                addr: req.orig,
                len: req.size,
            });
        }
        Ok(layout)
    }

    /// The map of a dynamic pool after its checks: the run from the pool list or a transient
    /// pool ([`DynamicPools::find_slots`]), then as a static map.
    #[inline(never)]
    fn map_dynamic<M: OrigMemory + ?Sized>(
        &self,
        d: &DynamicPools,
        mem: &M,
        req: &MapRequest,
        sreq: &SlotRequest,
        layout: &Layout,
    ) -> Fast<Mapping> {
        match d.find_slots(&self.tlb, sreq) {
            Some(Placed::Listed(tlb, index)) => {
                let index = self.checked_run(tlb, sreq, index)?;
                self.fill(tlb, index, mem, req, sreq, layout)
            }
            Some(Placed::Transient(tlb, index)) => {
                let start = tlb.geom.base;
                let r = self
                    .checked_run(&tlb, sreq, index)
                    .and_then(|index| self.fill(&tlb, index, mem, req, sreq, layout));
                if r.is_err() {
                    d.delete_transient(start);
                }
                r
            }
            None => fail(self.full(layout.alloc_size, req.attrs.no_warn)),
        }
    }

    /// Records, counts and copies in a map whose run `index..index + sreq.nslots` of `tlb` is
    /// claimed (Linux `swiotlb_tbl_map_single` after `swiotlb_find_slots`).
    #[inline(always)]
    fn fill<M: OrigMemory + ?Sized>(
        &self,
        tlb: &TlbPool,
        index: usize,
        mem: &M,
        req: &MapRequest,
        sreq: &SlotRequest,
        layout: &Layout,
    ) -> Fast<Mapping> {
        let nslots = sreq.nslots;
        // The thread's counter shard, looked up once for the whole map.
        let shard = self.counters.shard();
        self.counters.inc_used_on(shard, nslots);
        let (head, dev_addr) = Self::record(tlb, index, nslots, req.orig, layout);
        let copy_in = match self.copy_on_map {
            CopyOnMap::Always => true,
            CopyOnMap::WhenDeviceReads => req.dir.device_reads() && !req.attrs.skip_cpu_sync,
        };
        if copy_in {
            // The head slot's metadata as `record` just wrote it: no need to read it back.
            let view = SlotView {
                orig: req.orig,
                alloc_size: layout.alloc_size - layout.offset,
                offset: (layout.offset & (tlb.geom.slot_size() - 1)) as u32,
            };
            let at = CopyAt {
                tlb,
                view: Some(view),
            };
            let copied = self.bounce(mem, at, dev_addr, req.size, Direction::ToDevice, shard);
            if let Err(e) = copied {
                // The original vanished between the check and the copy: give the slots back.
                tlb.meta.slot(head).head.store(0, Ordering::Relaxed);
                self.release(tlb, index, nslots, req.worker, shard);
                return Err(e);
            }
        }
        shard.add(Stat::Maps, 1);
        Ok(Mapping {
            dev_addr,
            orig: req.orig,
            size: req.size,
            dir: req.dir,
            attrs: req.attrs,
            slot: index,
            nslots,
        })
    }

    /// The allocator request a map of `req` makes, as [`BouncePool::map`] builds it (size and
    /// mask checks, alignment padding, Linux's placement rules), without allocating anything:
    /// for measuring an allocator alone on exactly the requests the pool would give it.
    ///
    /// # Errors
    /// As [`BouncePool::map`] before it allocates: [`Error::ZeroLength`], [`Error::Overflow`],
    /// [`Error::BadAlignment`], [`Error::TooLarge`].
    pub fn slot_request(&self, req: &MapRequest) -> Result<SlotRequest> {
        let layout = self.layout(req).map_err(|e| *e)?;
        Ok(self.request_of(req, &layout))
    }

    /// The allocator request of `req` laid out as `layout`.
    #[inline(always)]
    fn request_of(&self, req: &MapRequest, layout: &Layout) -> SlotRequest {
        SlotRequest::new(
            &self.tlb.geom,
            req.orig,
            layout.alloc_size,
            req.alloc_align_mask,
            req.min_align_mask,
            req.seg_boundary_mask,
            req.worker,
        )
    }

    /// Checks a request's size and masks and computes where its data sits in the allocation
    /// (Linux `swiotlb_align_offset` and the `ALIGN(mapping_size + offset, ...)` of
    /// `swiotlb_tbl_map_single`).
    #[inline]
    fn layout(&self, req: &MapRequest) -> Fast<Layout> {
        let size = req.size;
        if size == 0 {
            return fail(Error::ZeroLength);
        }
        if req.orig.checked_add(size as u64).is_none() {
            return fail(Error::Overflow {
                orig: req.orig,
                size,
            });
        }
        // The three mask checks in one test; the error says which failed.
        if Self::holes(req.min_align_mask)
            | Self::holes(req.alloc_align_mask)
            | Self::holes(req.seg_boundary_mask)
            != 0
        {
            return fail(Self::mask_error(req));
        }
        let slot = self.tlb.geom.slot_size();
        if req.seg_boundary_mask < slot - 1 {
            return fail(Error::BadAlignment {
                reason: "segment boundary is smaller than a slot",
            });
        }
        let max = self.max_mapping_size(req.min_align_mask);
        // swiotlb_align_offset(dev, alloc_align_mask, orig)
        let offset = req.orig & req.min_align_mask & (req.alloc_align_mask | (slot - 1));
        // Rounded up to alloc_align_mask + 1 (a power of two, checked above) with a mask.
        let alloc_size = (size as u64 + offset)
            .checked_add(req.alloc_align_mask)
            .map_or(u64::MAX, |x| x & !req.alloc_align_mask);
        let seg_bytes = (self.tlb.geom.segsize as u64) << self.tlb.geom.slot_shift;
        let over_max = self.size_limit == SizeLimit::MaxMappingSize && size > max;
        if over_max || alloc_size > seg_bytes {
            return fail(Error::TooLarge { size, max });
        }
        Ok(Layout { offset, alloc_size })
    }

    /// Asks the allocator for a run and checks its answer; counts and reports a full pool.
    #[inline]
    fn claim(&self, sreq: &SlotRequest, alloc_size: u64, no_warn: bool) -> Fast<usize> {
        let Some(index) = self.tlb.alloc.alloc(sreq) else {
            return fail(self.full(alloc_size, no_warn));
        };
        self.checked_run(&self.tlb, sreq, index)
    }

    /// Counts and reports (rate-limited, unless `no_warn`) a map that found no run.
    #[cold]
    fn full(&self, alloc_size: u64, no_warn: bool) -> Error {
        self.counters.add(Stat::MapFailures, 1);
        let total = match self.dynamic() {
            Some(d) => usize::try_from(d.nslabs()).unwrap_or(usize::MAX),
            None => self.tlb.geom.nslabs,
        };
        let err = Error::PoolFull {
            size: usize::try_from(alloc_size).unwrap_or(usize::MAX),
            total,
            used: self.counters.used() as usize,
        };
        if !no_warn {
            self.warn_full(&err);
        }
        err
    }

    /// `index`, when the run the allocator of `tlb` returned for `sreq` there keeps every
    /// placement rule; else the run goes back and the map fails (an allocator bug: never hand
    /// out a run that breaks the rules).
    #[inline(always)]
    fn checked_run(&self, tlb: &TlbPool, sreq: &SlotRequest, index: usize) -> Fast<usize> {
        if !sreq.fits(&tlb.geom, index) {
            tracing::error!(
                allocator = %tlb.alloc.kind(),
                index,
                nslots = sreq.nslots,
                "allocator returned a run that breaks the placement rules"
            );
            tlb.alloc.free(index, sreq.nslots, sreq.worker);
            return fail(Error::BadAlignment {
                reason: "allocator returned a misplaced run",
            });
        }
        Ok(index)
    }

    /// Writes the metadata of a fresh allocation `index..index + nslots` (Linux: the
    /// `alloc_size` loop of `swiotlb_search_pool_area` and the `orig_addr` loop of
    /// `swiotlb_tbl_map_single`) and returns the head slot and the device address.
    #[inline]
    fn record(
        tlb: &TlbPool,
        index: usize,
        nslots: usize,
        orig: u64,
        layout: &Layout,
    ) -> (usize, u64) {
        let shift = tlb.geom.slot_shift;
        let slot = tlb.geom.slot_size();
        let pad_slots = (layout.offset >> shift) as usize;
        let in_slot = layout.offset & (slot - 1);
        // One pass over the run's metadata, bounds checked once. Per slot `i`: the bytes from
        // its start plus the in-slot offset to the end of the allocation (as in Linux, an
        // unsigned int there, this wraps below zero for a last slot whose data ends before the
        // in-slot offset; `bounce` reads it back as signed), and from the head on the original
        // address it shadows (`orig + (i - pad_slots) * slot`; padding slots keep `INVALID`).
        let run = tlb.meta.run(index, nslots);
        let mut left = layout.alloc_size.wrapping_sub(in_slot);
        let mut shadow = orig.wrapping_sub((pad_slots as u64) << shift);
        for (i, m) in run.iter().enumerate() {
            m.alloc_size.store(left, Ordering::Relaxed);
            m.offset.store(in_slot as u32, Ordering::Relaxed);
            if i >= pad_slots {
                m.orig.store(shadow, Ordering::Relaxed);
            }
            left = left.wrapping_sub(slot);
            shadow = shadow.wrapping_add(slot);
        }
        // pad_slots < nslots: the allocation covers the offset and at least one byte more.
        let head = &run[pad_slots];
        head.pad_slots.store(pad_slots as u32, Ordering::Relaxed);
        head.head.store(in_slot as u32 + 1, Ordering::Release);
        let head = index + pad_slots;
        (head, tlb.geom.slot_addr(head) + in_slot)
    }

    fn warn_full(&self, err: &Error) {
        let now = u64::try_from(self.created.elapsed().as_millis()).unwrap_or(u64::MAX);
        let last = self.last_full_warn_ms.load(Ordering::Relaxed);
        let interval = Duration::from_secs(1).as_millis() as u64;
        if (last == u64::MAX || now.saturating_sub(last) >= interval)
            && self
                .last_full_warn_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(allocator = %self.tlb.alloc.kind(), "{err}");
        }
    }

    /// Copies between the original and the pool for device addresses `addr..addr + size`
    /// (Linux `swiotlb_bounce`): `ToDevice` copies original -> pool, anything else pool ->
    /// original. The source is found through the metadata of the slot `addr` falls in, so any
    /// sub-range of a mapping works; a copy running past the allocation is clamped (and logged
    /// once).
    ///
    /// `at` is the pool `addr` is in, with the metadata of the slot `addr` falls in when the
    /// caller has it (map and unmap pass their head slot's).
    #[inline(always)]
    fn bounce<M: OrigMemory + ?Sized>(
        &self,
        mem: &M,
        at: CopyAt<'_>,
        addr: u64,
        size: usize,
        dir: Direction,
        shard: ShardRef<'_>,
    ) -> Fast<()> {
        self.timed(TimedOp::Copy, dir, || {
            if !self.contains(addr, size) {
                return fail(Error::OutOfPool { addr, len: size });
            }
            let tlb = at.tlb;
            let v = match at.view {
                Some(v) => v,
                None => {
                    let index = ((addr - tlb.geom.base) >> tlb.geom.slot_shift) as usize;
                    let m = tlb.meta.slot(index);
                    let orig = m.orig.load(Ordering::Relaxed);
                    if orig == INVALID {
                        return fail(Error::NotMapped { addr });
                    }
                    SlotView {
                        orig,
                        alloc_size: m.alloc_size.load(Ordering::Relaxed),
                        offset: m.offset.load(Ordering::Relaxed),
                    }
                }
            };
            let (orig, alloc_size) = (v.orig, v.alloc_size);
            // May be negative: addr can point into the first `offset` bytes of a later slot.
            let tlb_offset = (addr & (tlb.geom.slot_size() - 1)) as i64 - i64::from(v.offset);
            let orig = orig.wrapping_add(tlb_offset as u64);
            let avail = (alloc_size as i64).saturating_sub(tlb_offset).max(0) as u64;
            let mut size = size;
            if size as u64 > avail {
                if self.clamp_warned.swap(1, Ordering::Relaxed) == 0 {
                    tracing::warn!(
                        addr,
                        size,
                        avail,
                        "bounce copy runs past the end of its mapping; clamped"
                    );
                }
                shard.add(Stat::Clamped, 1);
                size = avail as usize;
            }
            if size == 0 {
                return Ok(());
            }
            // Inside the pool: checked above for the larger unclamped size.
            let slice = self
                .memory
                .get_slice((addr - self.window_base) as usize, size)
                .map_err(|_| Error::OutOfPool { addr, len: size })?;
            if dir == Direction::ToDevice {
                mem.read_orig(orig, &slice)?;
                shard.add(Stat::BytesToDevice, size as u64);
            } else {
                mem.write_orig(orig, &slice)?;
                shard.add(Stat::BytesFromDevice, size as u64);
            }
            Ok(())
        })
    }

    /// Marks `index..index + nslots` unmapped and returns the run to the allocator.
    ///
    /// Only `orig` is reset (Linux also zeroes `alloc_size` and `pad_slots`): it is what every
    /// reader checks first (a copy or sync of a slot whose `orig` is `INVALID` is refused before
    /// anything else is read), and the next map of a slot writes all its other fields before it
    /// publishes the head.
    #[inline]
    fn release(
        &self,
        tlb: &TlbPool,
        index: usize,
        nslots: usize,
        worker: usize,
        shard: ShardRef<'_>,
    ) {
        Self::forget(tlb, index, nslots);
        tlb.alloc.free(index, nslots, worker);
        self.counters.dec_used_on(shard, nslots);
    }

    /// Marks `index..index + nslots` unmapped: the metadata half of [`BouncePool::release`].
    #[inline(always)]
    fn forget(tlb: &TlbPool, index: usize, nslots: usize) {
        for m in tlb.meta.run(index, nslots) {
            m.orig.store(INVALID, Ordering::Relaxed);
        }
    }

    /// Unmaps a mapping returned by [`BouncePool::map`].
    ///
    /// # Errors
    /// As [`BouncePool::unmap_single`].
    #[inline]
    pub fn unmap<M: OrigMemory + ?Sized>(&self, mem: &M, m: &Mapping, worker: usize) -> Result<()> {
        self.unmap_single(mem, m.dev_addr, m.size, m.dir, m.attrs, worker)
    }

    /// Copies back as the rules say and releases the slots (Linux
    /// `__swiotlb_tbl_unmap_single` and `swiotlb_release_slots`).
    ///
    /// The slots are released even when the copy back fails; the error is then returned.
    ///
    /// # Errors
    /// [`Error::NotMapped`] when `addr` is not the device address of a live mapping (never
    /// mapped, already unmapped, or not what map returned): nothing changes then.
    /// [`Error::OrigAccess`] when the copy back failed.
    #[inline]
    pub fn unmap_single<M: OrigMemory + ?Sized>(
        &self,
        mem: &M,
        addr: u64,
        size: usize,
        dir: Direction,
        attrs: DmaAttrs,
        worker: usize,
    ) -> Result<()> {
        let u = UnmapArgs {
            addr,
            size,
            dir,
            attrs,
            worker,
        };
        self.timed(TimedOp::Unmap, dir, || self.unmap_untimed(mem, u))
            .map_err(|e| *e)
    }

    #[inline(always)]
    fn unmap_untimed<M: OrigMemory + ?Sized>(&self, mem: &M, u: UnmapArgs) -> Fast<()> {
        if let Some(d) = &self.dynamic {
            return self.unmap_dynamic(&d.pools, mem, u);
        }
        self.unmap_static(mem, u, |tlb, index, nslots, shard| {
            self.release(tlb, index, nslots, u.worker, shard);
        })
    }

    /// The unmap of a static pool: [`BouncePool::unmap_in`] its one pool, which must hold
    /// `u.addr`.
    #[inline(always)]
    fn unmap_static<M: OrigMemory + ?Sized>(
        &self,
        mem: &M,
        u: UnmapArgs,
        release: impl FnOnce(&TlbPool, usize, usize, ShardRef<'_>),
    ) -> Fast<()> {
        if !self.contains(u.addr, 1) {
            return self.bad_unmap(u.addr);
        }
        self.unmap_in(&self.tlb, mem, u, release)
    }

    /// Counts and refuses an unmap of an address that is no live mapping.
    #[cold]
    fn bad_unmap(&self, addr: u64) -> Fast<()> {
        self.counters.add(Stat::BadUnmaps, 1);
        fail(Error::NotMapped { addr })
    }

    /// The unmap of a dynamic pool: in the pool `addr` is in (Linux `swiotlb_find_pool`);
    /// a transient pool goes with its mapping (`swiotlb_del_transient`).
    #[inline(never)]
    fn unmap_dynamic<M: OrigMemory + ?Sized>(
        &self,
        d: &DynamicPools,
        mem: &M,
        u: UnmapArgs,
    ) -> Fast<()> {
        let Some(found) = d.pool_of(&self.tlb, u.addr) else {
            return self.bad_unmap(u.addr);
        };
        let r = self.unmap_in(&found, mem, u, |tlb, index, nslots, shard| {
            self.release(tlb, index, nslots, u.worker, shard);
        });
        if let Found::Transient(t) = &found {
            let released = !matches!(&r, Err(e) if matches!(**e, Error::NotMapped { .. }));
            if released {
                d.delete_transient(t.geom.base);
            }
        }
        r
    }

    /// Copies back and releases the mapping at `u.addr` in `tlb`, which holds `u.addr`:
    /// `release(tlb, first slot, slots, shard)` gives the run back ([`BouncePool::release`],
    /// or a batch's deferred release).
    #[inline(always)]
    fn unmap_in<M: OrigMemory + ?Sized>(
        &self,
        tlb: &TlbPool,
        mem: &M,
        u: UnmapArgs,
        release: impl FnOnce(&TlbPool, usize, usize, ShardRef<'_>),
    ) -> Fast<()> {
        let UnmapArgs {
            addr,
            size,
            dir,
            attrs,
            worker: _,
        } = u;
        let slot = ((addr - tlb.geom.base) >> tlb.geom.slot_shift) as usize;
        let in_slot = (addr & (tlb.geom.slot_size() - 1)) as u32;
        let m = tlb.meta.slot(slot);
        if m.head
            .compare_exchange(in_slot + 1, 0, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return self.bad_unmap(addr);
        }
        let shard = self.counters.shard();
        // The head slot's metadata, read once for the copy back and the release.
        let view = SlotView {
            orig: m.orig.load(Ordering::Relaxed),
            alloc_size: m.alloc_size.load(Ordering::Relaxed),
            offset: m.offset.load(Ordering::Relaxed),
        };
        let pad_slots = m.pad_slots.load(Ordering::Relaxed) as usize;
        let copied = if !attrs.skip_cpu_sync && dir.device_writes() {
            let at = CopyAt {
                tlb,
                view: Some(view),
            };
            self.bounce(mem, at, addr, size, Direction::FromDevice, shard)
        } else {
            Ok(())
        };
        // swiotlb_release_slots: Linux reads `alloc_size` of the first (padding) slot, which
        // `record` made the head's plus the padding: the same number without another line.
        let index = slot - pad_slots;
        let nslots = tlb.geom.nr_slots(
            view.alloc_size + ((pad_slots as u64) << tlb.geom.slot_shift) + u64::from(view.offset),
        ) as usize;
        release(tlb, index, nslots, shard);
        shard.add(Stat::Unmaps, 1);
        copied
    }

    /// Makes the device see the CPU's latest writes to `addr..addr + size` (any sub-range of
    /// a mapping) with [`SyncFor::Device`]: copies original -> pool for to-device and
    /// bidirectional, nothing for from-device (Linux `__swiotlb_sync_single_for_device`).
    /// Makes the CPU see the device's writes with [`SyncFor::Cpu`]: copies pool -> original
    /// for from-device and bidirectional, nothing for to-device (Linux
    /// `__swiotlb_sync_single_for_cpu`). Each call counts in its own statistic.
    ///
    /// # Errors
    /// [`Error::OutOfPool`], [`Error::NotMapped`] (the slot holds no mapping),
    /// [`Error::OrigAccess`].
    #[inline]
    pub fn sync<M: OrigMemory + ?Sized>(
        &self,
        mem: &M,
        addr: u64,
        size: usize,
        dir: Direction,
        target: SyncFor,
    ) -> Result<()> {
        let (stat, copy) = match target {
            SyncFor::Device => (
                Stat::SyncsForDevice,
                dir.device_reads().then_some(Direction::ToDevice),
            ),
            SyncFor::Cpu => (
                Stat::SyncsForCpu,
                dir.device_writes().then_some(Direction::FromDevice),
            ),
        };
        let shard = self.counters.shard();
        shard.add(stat, 1);
        match copy {
            Some(dir) => self.sync_copy(mem, addr, size, dir, shard),
            None => Ok(()),
        }
    }

    /// A sync's copy in direction `dir`, in the pool `addr` is in.
    fn sync_copy<M: OrigMemory + ?Sized>(
        &self,
        mem: &M,
        addr: u64,
        size: usize,
        dir: Direction,
        shard: ShardRef<'_>,
    ) -> Result<()> {
        let r = match self.dynamic() {
            None => self.bounce(mem, CopyAt::read(&self.tlb), addr, size, dir, shard),
            Some(d) => match d.pool_of(&self.tlb, addr) {
                Some(tlb) => self.bounce(mem, CopyAt::read(&tlb), addr, size, dir, shard),
                None => fail(Error::NotMapped { addr }),
            },
        };
        r.map_err(|e| *e)
    }

    /// Slots in use.
    pub fn used(&self) -> usize {
        self.counters.used() as usize
    }

    /// The high-water mark of [`BouncePool::used`] (`io_tlb_used_hiwater`).
    pub fn hiwater(&self) -> u64 {
        self.counters.hiwater()
    }

    /// Resets the high-water mark to zero (Linux only allows writing 0 to
    /// `io_tlb_used_hiwater`), the lock counters and the time histograms.
    pub fn reset_hiwater(&self) {
        self.counters.reset_hiwater();
        self.tlb.alloc.reset_lock_stats();
        self.timing.reset(&self.counters);
    }

    /// Turns the time accounting on (the default) or off.
    pub fn set_timing(&self, on: bool) {
        self.timing.set_enabled(on);
    }

    /// Times one call in `n` of each kind per thread, on average (the default is
    /// [`crate::stats::DEFAULT_SAMPLE_EVERY`]; 1 times every call). Call counts stay exact.
    pub fn set_timing_sample_every(&self, n: u32) {
        self.timing.set_sample_every(n);
    }

    /// A snapshot of the statistics.
    pub fn stats(&self) -> PoolStats {
        let c = &self.counters;
        let locks = self.tlb.alloc.lock_stats();
        PoolStats {
            mode: self.tlb.geom.mode,
            copy_on_map: self.copy_on_map,
            allocator: self.tlb.alloc.kind(),
            nslabs: self
                .dynamic()
                .map_or(self.tlb.geom.nslabs as u64, DynamicPools::nslabs),
            slot_size: self.tlb.geom.slot_size(),
            nareas: self.tlb.geom.nareas as u64,
            used: c.used(),
            used_hiwater: c.hiwater(),
            area_used: self
                .tlb
                .alloc
                .area_used()
                .into_iter()
                .map(|u| u as u64)
                .collect(),
            maps: c.get(Stat::Maps),
            unmaps: c.get(Stat::Unmaps),
            map_failures: c.get(Stat::MapFailures),
            bad_unmaps: c.get(Stat::BadUnmaps),
            bytes_to_device: c.get(Stat::BytesToDevice),
            bytes_from_device: c.get(Stat::BytesFromDevice),
            syncs_for_device: c.get(Stat::SyncsForDevice),
            syncs_for_cpu: c.get(Stat::SyncsForCpu),
            clamped: c.get(Stat::Clamped),
            lock_wait_ns: locks.iter().map(|l| l.wait_ns).sum(),
            locks,
            timing: self.timing.stats(&self.counters),
            dynamic: self.dynamic().map(|d| d.stats(&self.tlb)),
        }
    }

    /// Raises the high-water mark to `n` slots when it is lower (a replay starts it where the
    /// kernel's stood when the capture began).
    pub fn raise_hiwater(&self, n: u64) {
        self.counters.raise_hiwater(n);
    }

    /// True when the pool's mode is iova.
    pub fn is_iova(&self) -> bool {
        self.tlb.geom.mode == PoolMode::Iova
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_even_odd_pair_of_slots_has_a_cache_line_of_its_own() {
        // Several tables, so that both skews are likely to come up.
        for len in [1, 2, 3, 64, 4096, 32768] {
            let t = SlotTable::new(len);
            assert_eq!(t.slots().len(), len);
            let addr = |i: usize| t.slot(i) as *const SlotMeta as usize;
            assert_eq!(addr(0) % CACHE_LINE, 0, "slot 0 of {len} starts a line");
            for i in (0..len).step_by(2) {
                assert_eq!(addr(i) / CACHE_LINE, (addr(i) + 63) / CACHE_LINE);
                if i + 1 < len {
                    assert_eq!(
                        addr(i + 1),
                        addr(i) + 32,
                        "slot {} shares slot {i}'s line",
                        i + 1
                    );
                }
            }
            let run = t.run(len - 1, 1);
            assert_eq!(run.len(), 1);
            assert!(std::ptr::eq(&run[0], t.slot(len - 1)));
        }
    }

    #[test]
    #[should_panic]
    fn a_slot_past_the_table_is_refused_even_where_the_spare_entry_lies() {
        // Whatever the skew, the spare entry is not a slot.
        let t = SlotTable::new(8);
        let _ = t.run(7, 2);
    }
}
