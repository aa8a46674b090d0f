//! Dynamic swiotlb pools (Linux `CONFIG_SWIOTLB_DYNAMIC`, 6.12): a pool list, transient pools,
//! and a growth worker.
//!
//! A [`BouncePool`](crate::BouncePool) built with [`PoolConfig::dynamic`] set keeps, besides its
//! default pool, the pools Linux adds when the default one cannot serve a map
//! (`bounce/docs/dynamic-swiotlb.md` states the kernel's rules, with line numbers):
//!
//! - **Added pools** (`mem->pools`): made by the growth worker, searched newest first, never
//!   freed. A worker run asks for `min(default_nslabs, 2048)` slots (`MAX_PAGE_ORDER`: 4 MiB),
//!   halving down to 512 slots while the memory is not there, in
//!   `limit_nareas(default_nareas, nslabs)` areas ([`worker_sizes`]).
//! - **The search** (`swiotlb_find_slots`): for each area offset `i` below `default_nareas`,
//!   every pool newest first (the default one last) with more than `i` areas is tried in its
//!   area `(cpu + i) & (nareas - 1)`, with the static per-area search.
//! - **Growth**: a map no pool serves asks for a pool (`schedule_work`: requests while a run is
//!   pending merge into it) and gets a **transient pool** of exactly its slots in one area,
//!   searched like any area (it can still fail), freed at that map's unmap.
//! - **Counters** (debugfs): `io_tlb_nslabs` (default and added pools), `io_tlb_used` and its
//!   high-water mark (every pool, transient ones included), `io_tlb_transient_nslabs`.
//!
//! What the kernel leaves to its page allocator is an input here ([`PoolPages`]): with
//! [`PoolPages::Host`] the pools' memory comes from a window the pool maps itself, carved by an
//! aligned first-fit allocator ([`Blocks`], blocks of a power of two of pages aligned to their
//! size, as `alloc_pages` gives), and a background thread is the growth worker; with
//! [`PoolPages::Given`] (a trace replay) the caller says where each transient pool is (or that
//! its allocation failed) and applies each added pool where the kernel published it.
//!
//! The static pool's map and unmap do not come here: a pool without this state takes one
//! branch on it and runs the static path unchanged.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;

use serde::{Deserialize, Serialize};

use crate::alloc::SlotRequest;
use crate::error::{Error, Result};
use crate::geometry::Geometry;
use crate::pool::TlbPool;
use crate::types::PoolMode;
use crate::{IO_TLB_SEGSIZE, IO_TLB_SHIFT, PAGE_SHIFT};

/// The most slots the growth worker asks for: `SLABS_PER_PAGE << MAX_PAGE_ORDER` (x86: 4 KiB
/// pages, `MAX_PAGE_ORDER` 10: 4 MiB).
pub const MAX_POOL_SLABS: usize = (1 << (PAGE_SHIFT - IO_TLB_SHIFT)) << 10;
/// The fewest slots the worker halves down to (`IO_TLB_MIN_SLABS`: 1 MiB).
pub const MIN_POOL_SLABS: usize = (1 << 20) >> IO_TLB_SHIFT;
/// The most pools a pool list holds besides the default one (at least 1 GiB of added pools;
/// Linux has no such bound, its memory is one). A worker run or a replayed addition beyond it
/// fails.
pub const MAX_ADDED_POOLS: usize = 4096;

/// Where the memory of added and transient pools comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PoolPages {
    /// The pool maps a window of `slots` slots at the configuration's `base`, puts the default
    /// pool at its start and carves added and transient pools from the rest ([`Blocks`]); a
    /// background thread runs the growth worker.
    Host {
        /// Slots of the whole window (default pool included).
        slots: usize,
    },
    /// As [`PoolPages::Host`], without the thread: the caller runs the growth worker where it
    /// chooses ([`DynamicPools::run_pending_worker`]), so a replay of a workload that has no
    /// pool events of its own (a what-if of the sizing advisor) grows at the same points on
    /// every run.
    HostStepped {
        /// Slots of the whole window (default pool included).
        slots: usize,
    },
    /// The caller gives every address ([`DynamicPools::give_transient`],
    /// [`DynamicPools::add_pool`]): device addresses `window_base..window_base + window_bytes`
    /// are backed by memory, and the default pool sits at the configuration's `base` inside it.
    Given {
        /// First device address of the window.
        window_base: u64,
        /// Bytes of the window.
        window_bytes: u64,
    },
}

/// The dynamic part of a [`PoolConfig`](crate::PoolConfig).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DynamicConfig {
    /// Where pool memory comes from.
    pub pages: PoolPages,
    /// Linux `mem->can_grow` (true on x86 without a remap callback): without it a map that no
    /// pool serves fails, as in the static kernel.
    pub can_grow: bool,
}

impl DynamicConfig {
    /// How many default pools' worth of slots [`DynamicConfig::host`] gives the window when
    /// none is named.
    pub const DEFAULT_WINDOW_FACTOR: usize = 8;

    /// A pool that grows into memory of its own: `slots` slots in all (default pool
    /// included).
    pub fn host(slots: usize) -> Self {
        Self {
            pages: PoolPages::Host { slots },
            can_grow: true,
        }
    }
}

/// Which kind of pool a mapping is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PoolKind {
    /// The pool made at boot.
    Default,
    /// A pool the growth worker added.
    Added,
    /// A pool made for one mapping, freed at its unmap.
    Transient,
}

impl PoolKind {
    /// The name the kernel trace uses (`kernel_pool_kind`).
    pub fn name(self) -> &'static str {
        match self {
            PoolKind::Default => "default",
            PoolKind::Added => "added",
            PoolKind::Transient => "transient",
        }
    }
}

/// One pool of a dynamic pool list: where it is and how it is split.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolInfo {
    /// Device address of its first slot (Linux `pool->start`).
    pub start: u64,
    /// Slots.
    pub nslabs: usize,
    /// Areas.
    pub nareas: usize,
    /// Its kind.
    pub kind: PoolKind,
}

/// The statistics of a dynamic pool: the counters Linux's debugfs shows and what the growth
/// machinery did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DynamicStats {
    /// `io_tlb_nslabs`: slots of the default and the added pools.
    pub io_tlb_nslabs: u64,
    /// `io_tlb_transient_nslabs`: slots of the live transient pools.
    pub io_tlb_transient_nslabs: u64,
    /// The bound of the search loop and the area count asked of added pools (Linux
    /// `default_nareas`).
    pub default_nareas: u64,
    /// Pools added by the growth worker.
    pub pools_added: u64,
    /// Their slots.
    pub added_nslabs: u64,
    /// Maps that asked for growth (no pool could serve them).
    pub grow_requests: u64,
    /// Growth worker runs.
    pub worker_runs: u64,
    /// Worker runs that got no memory, even at the smallest size.
    pub worker_alloc_failed: u64,
    /// Transient pools made.
    pub transient_pools: u64,
    /// Transient pools live now.
    pub transient_live: u64,
    /// Transient pool allocations that got no memory (the map failed).
    pub transient_alloc_failed: u64,
    /// Transient pools in which the map's slot search failed (the map failed).
    pub transient_search_failed: u64,
    /// The default and added pools, newest first (the default one last).
    pub pools: Vec<PoolInfo>,
}

/// Linux `limit_nareas`: fewer areas for a pool too small for `128` slots each.
pub fn limit_nareas(nareas: usize, nslots: usize) -> usize {
    if nslots < nareas.saturating_mul(IO_TLB_SEGSIZE) {
        nslots / IO_TLB_SEGSIZE
    } else {
        nareas
    }
}

/// The sizes one growth-worker run tries, in order, as `(nslabs, nareas)` (Linux
/// `swiotlb_alloc_pool(NULL, IO_TLB_MIN_SLABS, default_nslabs, default_nareas, ...)`): at most
/// [`MAX_POOL_SLABS`], halved (rounded up to a segment) while above [`MIN_POOL_SLABS`]; one
/// try when `default_nslabs` is that small already. `limit_nareas` applies at every size (it
/// changes nothing while the pool has 128 slots per area, which the default pool's rounding
/// guarantees at `default_nslabs`).
pub fn worker_sizes(default_nslabs: usize, default_nareas: usize) -> Vec<(usize, usize)> {
    let mut n = default_nslabs.min(MAX_POOL_SLABS);
    let mut sizes = vec![(n, limit_nareas(default_nareas, n))];
    while n > MIN_POOL_SLABS {
        n = (n / 2).next_multiple_of(IO_TLB_SEGSIZE);
        sizes.push((n, limit_nareas(default_nareas, n)));
    }
    sizes
}

/// A snapshot of a dynamic pool's event counts ([`DynamicPools::events`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DynamicEvents {
    /// Maps that asked for growth.
    pub grow_requests: u64,
    /// Transient pools made.
    pub transient_pools: u64,
    /// Transient pool allocations that failed.
    pub transient_alloc_failed: u64,
    /// Transient pools whose slot search failed.
    pub transient_search_failed: u64,
}

/// An aligned first-fit allocator of device addresses in a window: what the kernel's page
/// allocator is to swiotlb, for a pool that grows into memory of its own. Blocks are a power of
/// two of pages, aligned to their size (`alloc_pages(order)`).
#[derive(Debug)]
pub struct Blocks {
    /// Free ranges, start -> end (exclusive), never adjacent (merged on free).
    free: BTreeMap<u64, u64>,
}

impl Blocks {
    /// Every address of `start..end` free.
    pub fn new(start: u64, end: u64) -> Self {
        let mut free = BTreeMap::new();
        if start < end {
            free.insert(start, end);
        }
        Self { free }
    }

    /// The block size `alloc_pages` gives for `bytes`: a power of two of pages.
    pub fn block_bytes(bytes: u64) -> u64 {
        bytes.max(1 << PAGE_SHIFT).next_power_of_two()
    }

    /// Takes the first block of [`Blocks::block_bytes`]`(bytes)` aligned to its size; `None`
    /// when no free range holds one.
    pub fn alloc(&mut self, bytes: u64) -> Option<u64> {
        let size = Self::block_bytes(bytes);
        let (s, e, at) = self.free.iter().find_map(|(&s, &e)| {
            let at = s.checked_next_multiple_of(size)?;
            (at.checked_add(size)? <= e).then_some((s, e, at))
        })?;
        self.take(s, e, at, at + size);
        Some(at)
    }

    /// Takes `start..start + bytes` exactly (the default pool's place); false when any of it
    /// is not free.
    pub fn reserve(&mut self, start: u64, bytes: u64) -> bool {
        let Some(end) = start.checked_add(bytes) else {
            return false;
        };
        match self.free.range(..=start).next_back() {
            Some((&s, &e)) if e >= end => {
                self.take(s, e, start, end);
                true
            }
            _ => false,
        }
    }

    fn take(&mut self, s: u64, e: u64, at: u64, end: u64) {
        self.free.remove(&s);
        if s < at {
            self.free.insert(s, at);
        }
        if end < e {
            self.free.insert(end, e);
        }
    }

    /// Returns the block [`Blocks::alloc`] gave for `bytes` at `start`.
    pub fn free(&mut self, start: u64, bytes: u64) {
        let mut s = start;
        let mut e = start.saturating_add(Self::block_bytes(bytes));
        if let Some((&ps, &pe)) = self.free.range(..s).next_back() {
            if pe == s {
                self.free.remove(&ps);
                s = ps;
            }
        }
        if let Some(ne) = self.free.remove(&e) {
            e = ne;
        }
        self.free.insert(s, e);
    }

    /// Free bytes.
    pub fn free_bytes(&self) -> u64 {
        self.free.iter().map(|(s, e)| e - s).sum()
    }
}

/// Where the pages of new pools come from (see [`PoolPages`]).
#[derive(Debug)]
enum Pages {
    /// Our own allocator over the window.
    Host(Mutex<Blocks>),
    /// The caller's answers for the next transient pools, in order: a start address, or
    /// `None` for an allocation that failed.
    Given(Mutex<VecDeque<Option<u64>>>),
}

/// The growth work item's state (Linux `mem->dyn_alloc` and its PENDING bit).
#[derive(Debug, Default)]
struct Work {
    /// A run is queued and has not started.
    pending: bool,
    /// The pool is going away: the worker thread ends.
    stop: bool,
}

/// Event counts of the growth machinery.
#[derive(Debug, Default)]
struct Events {
    grow_requests: AtomicU64,
    worker_runs: AtomicU64,
    worker_alloc_failed: AtomicU64,
    transient_pools: AtomicU64,
    transient_alloc_failed: AtomicU64,
    transient_search_failed: AtomicU64,
    added_nslabs: AtomicU64,
}

/// The dynamic pools of a [`BouncePool`](crate::BouncePool): the added pools, the live
/// transient pools, the counters and the growth work item. Shared with the worker thread.
#[derive(Debug)]
pub struct DynamicPools {
    /// Linux `default_nareas`.
    default_nareas: usize,
    /// Linux `default_nslabs`: the default pool's slots.
    default_nslabs: usize,
    /// Linux `mem->can_grow`.
    can_grow: bool,
    /// Workers (CPUs) the pools are built for.
    nworkers: usize,
    /// Device addresses backed by memory.
    window: (u64, u64),
    /// Added pools in the order they were published; readers see `published` of them (an
    /// append-only list: a map walks it without a lock, as Linux walks `mem->pools` under RCU).
    added: Box<[OnceLock<Box<TlbPool>>]>,
    /// How many of `added` are visible.
    published: AtomicUsize,
    /// Serialises additions (Linux `mem->lock`).
    add_lock: Mutex<()>,
    /// Live transient pools by start address (Linux: the devices' `dma_io_tlb_pools`).
    transient: Mutex<BTreeMap<u64, Arc<TlbPool>>>,
    pages: Pages,
    /// `io_tlb_nslabs`.
    nslabs: AtomicU64,
    /// `io_tlb_transient_nslabs`.
    transient_nslabs: AtomicU64,
    events: Events,
    work: Mutex<Work>,
    wake: Condvar,
    /// Set once the worker's "failed to allocate" was logged.
    alloc_warned: AtomicBool,
    /// A background thread runs the growth worker ([`PoolPages::Host`]).
    worker_thread: bool,
}

/// Where a map was placed by [`DynamicPools::find_slots`].
#[derive(Debug)]
pub(crate) enum Placed<'a> {
    /// In the default pool or an added one.
    Listed(&'a TlbPool, usize),
    /// In a fresh transient pool.
    Transient(Arc<TlbPool>, usize),
}

/// The pool a device address is in, as [`DynamicPools::pool_of`] finds it.
#[derive(Debug)]
pub(crate) enum Found<'a> {
    /// The default pool or an added one.
    Listed(&'a TlbPool),
    /// A live transient pool.
    Transient(Arc<TlbPool>),
}

impl std::ops::Deref for Found<'_> {
    type Target = TlbPool;

    fn deref(&self) -> &TlbPool {
        match self {
            Found::Listed(p) => p,
            Found::Transient(p) => p,
        }
    }
}

impl DynamicPools {
    /// The dynamic state of a pool whose default pool has geometry `geom`, with `default_nareas`
    /// (the area count asked for, before `limit_nareas`) and memory from `pages`; the window
    /// is `window` (first device address, bytes).
    ///
    /// # Errors
    /// [`Error::Config`] for an iova geometry or a window that does not hold the default pool.
    pub(crate) fn new(
        geom: &Geometry,
        default_nareas: usize,
        config: &DynamicConfig,
        window: (u64, u64),
    ) -> Result<Self> {
        if geom.mode != PoolMode::Swiotlb {
            return Err(Error::Config("dynamic pools need swiotlb mode".into()));
        }
        let default_bytes = geom.bytes() as u64;
        let (wbase, wbytes) = window;
        let Some(wend) = wbase.checked_add(wbytes) else {
            return Err(Error::Config(format!(
                "a window of {wbytes} bytes at {wbase:#x} overflows"
            )));
        };
        if geom.base < wbase
            || (geom.base - wbase)
                .checked_add(default_bytes)
                .is_none_or(|end| end > wbytes)
        {
            return Err(Error::Config(format!(
                "the default pool ({default_bytes} bytes at {:#x}) is not inside the window \
                 ({wbytes} bytes at {wbase:#x})",
                geom.base
            )));
        }
        let pages = match config.pages {
            PoolPages::Host { .. } | PoolPages::HostStepped { .. } => {
                let mut b = Blocks::new(wbase, wend);
                b.reserve(geom.base, default_bytes);
                Pages::Host(Mutex::new(b))
            }
            PoolPages::Given { .. } => Pages::Given(Mutex::new(VecDeque::new())),
        };
        // Every added pool has at least a segment of slots: the window bounds their number.
        let capacity =
            usize::try_from(wbytes >> IO_TLB_SHIFT).unwrap_or(usize::MAX) / IO_TLB_SEGSIZE;
        Ok(Self {
            default_nareas,
            default_nslabs: geom.nslabs,
            can_grow: config.can_grow,
            nworkers: geom.nworkers,
            window,
            added: (0..capacity).map(|_| OnceLock::new()).collect(),
            published: AtomicUsize::new(0),
            add_lock: Mutex::new(()),
            transient: Mutex::new(BTreeMap::new()),
            pages,
            nslabs: AtomicU64::new(geom.nslabs as u64),
            transient_nslabs: AtomicU64::new(0),
            events: Events::default(),
            work: Mutex::new(Work::default()),
            wake: Condvar::new(),
            alloc_warned: AtomicBool::new(false),
            worker_thread: matches!(config.pages, PoolPages::Host { .. }),
        })
    }

    /// Linux `default_nareas`.
    pub fn default_nareas(&self) -> usize {
        self.default_nareas
    }

    /// Linux `default_nslabs`.
    pub fn default_nslabs(&self) -> usize {
        self.default_nslabs
    }

    /// `io_tlb_nslabs`.
    pub fn nslabs(&self) -> u64 {
        self.nslabs.load(Ordering::Relaxed)
    }

    /// `io_tlb_transient_nslabs`.
    pub fn transient_nslabs(&self) -> u64 {
        self.transient_nslabs.load(Ordering::Relaxed)
    }

    /// Maps that asked for growth so far.
    pub fn grow_requests(&self) -> u64 {
        self.events.grow_requests.load(Ordering::Relaxed)
    }

    /// The event counts now.
    pub fn events(&self) -> DynamicEvents {
        let e = &self.events;
        DynamicEvents {
            grow_requests: e.grow_requests.load(Ordering::Relaxed),
            transient_pools: e.transient_pools.load(Ordering::Relaxed),
            transient_alloc_failed: e.transient_alloc_failed.load(Ordering::Relaxed),
            transient_search_failed: e.transient_search_failed.load(Ordering::Relaxed),
        }
    }

    /// The added pools visible now, newest first.
    fn added_pools(&self) -> impl Iterator<Item = &TlbPool> {
        let n = self.published.load(Ordering::Acquire);
        self.added[..n.min(self.added.len())]
            .iter()
            .rev()
            .filter_map(|p| p.get().map(|b| &**b))
    }

    /// Linux `swiotlb_find_slots` over the pool list (`default` last): the first area that
    /// serves `req`, in the kernel's order. With none, and growth allowed, a growth request and
    /// a transient pool for this map alone. `None`: the map fails.
    pub(crate) fn find_slots<'a>(
        &'a self,
        default: &'a TlbPool,
        req: &SlotRequest,
    ) -> Option<Placed<'a>> {
        let cpu = req.worker;
        for i in 0..self.default_nareas {
            for pool in self.added_pools().chain(std::iter::once(default)) {
                let nareas = pool.geom.nareas;
                if i >= nareas {
                    continue;
                }
                let area = cpu.wrapping_add(i) & (nareas - 1);
                if let Some(index) = pool.alloc.alloc_in_area(area, req) {
                    return Some(Placed::Listed(pool, index));
                }
            }
        }
        if !self.can_grow {
            return None;
        }
        self.request_growth();
        self.transient_pool(req)
    }

    /// A transient pool of exactly `req.nslots` slots in one area, and the run for `req` in
    /// it (Linux `swiotlb_find_slots`, the `swiotlb_alloc_pool(dev, nslabs, nslabs, 1, ...)`
    /// branch).
    fn transient_pool(&self, req: &SlotRequest) -> Option<Placed<'static>> {
        let nslabs = req.nslots;
        let bytes = (nslabs as u64) << IO_TLB_SHIFT;
        let Some(start) = self.pages_for_transient(bytes) else {
            self.events
                .transient_alloc_failed
                .fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let pool = self
            .geometry(start, nslabs, 1)
            .and_then(|g| TlbPool::new(g, true));
        let pool = match pool {
            Ok(p) => p,
            Err(e) => {
                tracing::error!("transient pool at {start:#x}: {e}");
                self.free_pages(start, bytes);
                self.events
                    .transient_alloc_failed
                    .fetch_add(1, Ordering::Relaxed);
                return None;
            }
        };
        let Some(index) = pool.alloc.alloc_in_area(0, req) else {
            // swiotlb_dyn_free at once: no slot fitted in the fresh pool.
            self.free_pages(start, bytes);
            self.events
                .transient_search_failed
                .fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let pool = Arc::new(pool);
        self.lock_transient().insert(start, Arc::clone(&pool));
        self.transient_nslabs
            .fetch_add(nslabs as u64, Ordering::Relaxed);
        self.events.transient_pools.fetch_add(1, Ordering::Relaxed);
        Some(Placed::Transient(pool, index))
    }

    fn lock_transient(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<TlbPool>>> {
        self.transient.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn pages_for_transient(&self, bytes: u64) -> Option<u64> {
        match &self.pages {
            Pages::Host(b) => b.lock().unwrap_or_else(|p| p.into_inner()).alloc(bytes),
            Pages::Given(q) => q
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front()
                .flatten(),
        }
    }

    fn free_pages(&self, start: u64, bytes: u64) {
        if let Pages::Host(b) = &self.pages {
            b.lock()
                .unwrap_or_else(|p| p.into_inner())
                .free(start, bytes);
        }
    }

    /// The geometry of a pool at `start`, checked against the window.
    fn geometry(&self, start: u64, nslabs: usize, nareas: usize) -> Result<Geometry> {
        let bytes = u64::try_from(nslabs)
            .ok()
            .and_then(|n| n.checked_shl(IO_TLB_SHIFT))
            .filter(|b| b >> IO_TLB_SHIFT == nslabs as u64);
        let (wbase, wbytes) = self.window;
        let inside = bytes.is_some_and(|b| {
            start >= wbase && (start - wbase).checked_add(b).is_some_and(|e| e <= wbytes)
        });
        if nslabs == 0
            || start & ((1 << IO_TLB_SHIFT) - 1) != 0
            || !inside
            || nareas == 0
            || !nareas.is_power_of_two()
            || nslabs % nareas != 0
        {
            return Err(Error::Config(format!(
                "a pool of {nslabs} slots in {nareas} areas at {start:#x} does not fit the \
                 window ({wbytes} bytes at {wbase:#x})"
            )));
        }
        Ok(Geometry {
            mode: PoolMode::Swiotlb,
            nslabs,
            nareas,
            area_nslabs: nslabs / nareas,
            slot_shift: IO_TLB_SHIFT,
            segsize: IO_TLB_SEGSIZE,
            base: start,
            nworkers: self.nworkers,
        })
    }

    /// Linux `schedule_work(&mem->dyn_alloc)`: counts the request and queues a worker run
    /// unless one is queued and has not started.
    fn request_growth(&self) {
        self.events.grow_requests.fetch_add(1, Ordering::Relaxed);
        let mut w = self.work.lock().unwrap_or_else(|p| p.into_inner());
        if !w.pending {
            w.pending = true;
            self.wake.notify_one();
        }
    }

    /// True when a worker run is queued and has not started (the work's PENDING bit).
    pub fn growth_pending(&self) -> bool {
        self.work.lock().unwrap_or_else(|p| p.into_inner()).pending
    }

    /// The pool (default, added or live transient) device address `addr` is in (Linux
    /// `swiotlb_find_pool`: `mem->pools`, then the device's transient pools).
    pub(crate) fn pool_of<'a>(&'a self, default: &'a TlbPool, addr: u64) -> Option<Found<'a>> {
        if default.holds(addr) {
            return Some(Found::Listed(default));
        }
        if let Some(p) = self.added_pools().find(|p| p.holds(addr)) {
            return Some(Found::Listed(p));
        }
        let t = self.lock_transient();
        let (_, p) = t.range(..=addr).next_back()?;
        p.holds(addr).then(|| Found::Transient(Arc::clone(p)))
    }

    /// Linux `swiotlb_del_transient`, after the unmap released the transient pool at `start`:
    /// the pool leaves the list and its pages return.
    pub(crate) fn delete_transient(&self, start: u64) {
        let Some(pool) = self.lock_transient().remove(&start) else {
            return;
        };
        let nslabs = pool.geom.nslabs;
        self.transient_nslabs
            .fetch_sub(nslabs as u64, Ordering::Relaxed);
        self.free_pages(start, (nslabs as u64) << IO_TLB_SHIFT);
    }

    /// Gives the answer of the page allocator to the next transient pool allocation: where its
    /// memory starts, or `None` when the allocation fails ([`PoolPages::Given`] only; a
    /// pool with its own memory ignores it).
    pub fn give_transient(&self, start: Option<u64>) {
        if let Pages::Given(q) = &self.pages {
            q.lock().unwrap_or_else(|p| p.into_inner()).push_back(start);
        }
    }

    /// Answers given by [`DynamicPools::give_transient`] that no map took yet; they are
    /// dropped.
    pub fn take_unused_given(&self) -> usize {
        match &self.pages {
            Pages::Given(q) => {
                let mut q = q.lock().unwrap_or_else(|p| p.into_inner());
                let n = q.len();
                q.clear();
                n
            }
            Pages::Host(_) => 0,
        }
    }

    /// Publishes a pool of `nslabs` slots in `nareas` areas at `start` (Linux `add_mem_pool`
    /// at the end of a `swiotlb_dyn_alloc` run): at the head of the list, so every later map
    /// searches it first; `io_tlb_nslabs` grows. The worker thread calls this with memory of
    /// its own; a replay calls it where the kernel published the pool. A run answers the
    /// pending request: the PENDING bit is cleared.
    ///
    /// # Errors
    /// [`Error::Config`] when the pool does not fit the window, is not of whole segments per
    /// area, or the list is full.
    pub fn add_pool(&self, start: u64, nslabs: usize, nareas: usize) -> Result<PoolInfo> {
        let geom = self.geometry(start, nslabs, nareas)?;
        let pool = TlbPool::new(geom, false)?;
        {
            let mut w = self.work.lock().unwrap_or_else(|p| p.into_inner());
            w.pending = false;
        }
        self.events.worker_runs.fetch_add(1, Ordering::Relaxed);
        self.publish(pool)
    }

    fn publish(&self, pool: TlbPool) -> Result<PoolInfo> {
        let _g = self.add_lock.lock().unwrap_or_else(|p| p.into_inner());
        let n = self.published.load(Ordering::Relaxed);
        let info = pool.info(PoolKind::Added);
        let slot = self.added.get(n).ok_or_else(|| {
            Error::Config(format!(
                "no room for pool {} in the list (at most {MAX_ADDED_POOLS} added pools)",
                n + 1
            ))
        })?;
        if slot.set(Box::new(pool)).is_err() {
            return Err(Error::Config("pool list slot taken twice".into()));
        }
        self.published.store(n + 1, Ordering::Release);
        self.nslabs.fetch_add(info.nslabs as u64, Ordering::Relaxed);
        self.events
            .added_nslabs
            .fetch_add(info.nslabs as u64, Ordering::Relaxed);
        Ok(info)
    }

    /// One growth worker run with memory of its own (Linux `swiotlb_dyn_alloc`): the first
    /// size of [`worker_sizes`] the window has a block for becomes a new pool. `None` when
    /// none does (logged once) or the pages are given by the caller.
    fn run_worker(&self) -> Option<PoolInfo> {
        let Pages::Host(blocks) = &self.pages else {
            return None;
        };
        self.events.worker_runs.fetch_add(1, Ordering::Relaxed);
        for (nslabs, nareas) in worker_sizes(self.default_nslabs, self.default_nareas) {
            let bytes = (nslabs as u64) << IO_TLB_SHIFT;
            let Some(start) = blocks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .alloc(bytes)
            else {
                continue;
            };
            let made = self
                .geometry(start, nslabs, nareas)
                .and_then(|g| TlbPool::new(g, false))
                .and_then(|p| self.publish(p));
            match made {
                Ok(info) => return Some(info),
                Err(e) => {
                    tracing::error!("growth worker: {e}");
                    self.free_pages(start, bytes);
                    break;
                }
            }
        }
        self.events
            .worker_alloc_failed
            .fetch_add(1, Ordering::Relaxed);
        if !self.alloc_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                window_bytes = self.window.1,
                "swiotlb: failed to allocate a new pool (the window is full)"
            );
        }
        None
    }

    /// One growth worker run in the caller's thread when a request is pending: PENDING is
    /// cleared as the run starts, as the worker thread does. `None` when nothing is pending,
    /// the run got no memory, or the pages are given by the caller.
    pub fn run_pending_worker(&self) -> Option<PoolInfo> {
        {
            let mut w = self.work.lock().unwrap_or_else(|p| p.into_inner());
            if !w.pending {
                return None;
            }
            w.pending = false;
        }
        self.run_worker()
    }

    /// Bytes of the window the pools take now (default, added and live transient pools, each
    /// a block as [`Blocks`] gives it) with memory of their own; `None` when the pages are
    /// given by the caller.
    pub fn pages_in_use(&self) -> Option<u64> {
        match &self.pages {
            Pages::Host(b) => {
                let free = b.lock().unwrap_or_else(|p| p.into_inner()).free_bytes();
                Some(self.window.1.saturating_sub(free))
            }
            Pages::Given(_) => None,
        }
    }

    /// The worker thread's loop: waits for a request, clears PENDING as the run starts, runs.
    fn worker_loop(&self) {
        loop {
            {
                let mut w = self.work.lock().unwrap_or_else(|p| p.into_inner());
                while !w.pending && !w.stop {
                    w = self.wake.wait(w).unwrap_or_else(|p| p.into_inner());
                }
                if w.stop {
                    return;
                }
                w.pending = false;
            }
            self.run_worker();
        }
    }

    /// The statistics (`default` is the pool's default pool).
    pub(crate) fn stats(&self, default: &TlbPool) -> DynamicStats {
        let e = &self.events;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut pools: Vec<PoolInfo> = self
            .added_pools()
            .map(|p| p.info(PoolKind::Added))
            .collect();
        pools.push(default.info(PoolKind::Default));
        DynamicStats {
            io_tlb_nslabs: self.nslabs(),
            io_tlb_transient_nslabs: self.transient_nslabs(),
            default_nareas: self.default_nareas as u64,
            pools_added: (pools.len() - 1) as u64,
            added_nslabs: get(&e.added_nslabs),
            grow_requests: get(&e.grow_requests),
            worker_runs: get(&e.worker_runs),
            worker_alloc_failed: get(&e.worker_alloc_failed),
            transient_pools: get(&e.transient_pools),
            transient_live: self.lock_transient().len() as u64,
            transient_alloc_failed: get(&e.transient_alloc_failed),
            transient_search_failed: get(&e.transient_search_failed),
            pools,
        }
    }
}

/// A pool's dynamic state and, with memory of its own, its growth worker thread (stopped and
/// joined on drop).
#[derive(Debug)]
pub(crate) struct Dynamic {
    pub pools: Arc<DynamicPools>,
    worker: Option<JoinHandle<()>>,
}

impl Dynamic {
    /// Starts the worker thread when the pages are the pool's own.
    ///
    /// # Errors
    /// [`Error::Config`] when the thread cannot be started.
    pub fn new(pools: DynamicPools) -> Result<Self> {
        let pools = Arc::new(pools);
        let worker = match pools.pages {
            Pages::Host(_) if pools.worker_thread => {
                let p = Arc::clone(&pools);
                Some(
                    std::thread::Builder::new()
                        .name("swiotlb-dyn".into())
                        .spawn(move || p.worker_loop())
                        .map_err(|e| Error::Config(format!("growth worker thread: {e}")))?,
                )
            }
            Pages::Host(_) | Pages::Given(_) => None,
        };
        Ok(Self { pools, worker })
    }
}

impl Drop for Dynamic {
    fn drop(&mut self) {
        if let Some(h) = self.worker.take() {
            {
                let mut w = self.pools.work.lock().unwrap_or_else(|p| p.into_inner());
                w.stop = true;
            }
            self.pools.wake.notify_all();
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_sizes_follow_the_kernel() {
        // swiotlb=4096,32: capped at 2048 slots in 16 areas, halved to 512.
        assert_eq!(
            worker_sizes(4096, 32),
            vec![(2048, 16), (1024, 8), (512, 4)]
        );
        // swiotlb=512,4: one size, no halving below the minimum.
        assert_eq!(worker_sizes(512, 4), vec![(512, 4)]);
        // swiotlb=128,1: one try at the default size.
        assert_eq!(worker_sizes(128, 1), vec![(128, 1)]);
        assert_eq!(worker_sizes(1536, 1), vec![(1536, 1), (768, 1), (384, 1)]);
        assert_eq!(limit_nareas(32, 2048), 16);
        assert_eq!(limit_nareas(4, 512), 4);
    }

    #[test]
    fn blocks_are_aligned_to_their_size_and_merge_back() {
        let mut b = Blocks::new(0x10_0000, 0x20_0000);
        assert!(b.reserve(0x10_0000, 0x4_0000));
        // 82 KiB takes a 128 KiB block on a 128 KiB boundary.
        assert_eq!(b.alloc(82 * 1024), Some(0x14_0000));
        assert_eq!(b.alloc(4096), Some(0x16_0000));
        assert_eq!(b.alloc(0x8_0000), Some(0x18_0000));
        assert_eq!(b.alloc(0x8_0000), None);
        b.free(0x14_0000, 82 * 1024);
        b.free(0x16_0000, 100);
        b.free(0x18_0000, 0x8_0000);
        assert_eq!(b.free_bytes(), 0x10_0000 - 0x4_0000);
        assert_eq!(b.alloc(0x8_0000), Some(0x18_0000));
        assert!(!b.reserve(0x18_0000, 1));
    }
}
