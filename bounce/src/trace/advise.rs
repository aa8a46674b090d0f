//! Pool sizing from a trace: the smallest pool with no "buffer is full" for that trace, found by
//! replaying it, and why each failure at the current size happened.
//!
//! The search works in steps of one segment per area (128 slots each), so every area holds
//! whole segments: it doubles the pool from one step until a replay has no pool-full failure,
//! then bisects down to the step where one step less fails. That size, `min_slots`, is reachable
//! only with a hand-built geometry (the replay builds one). Linux and `PoolConfig` round a pool
//! up (to a multiple of 128 slots, at least 128 per area, then to a power of two once an area
//! count is known), so the advice for a guest (`swiotlb=<slots>,<areas>`) and for the host
//! (`--bounce slots=`) is `min_slots` after that rounding, and is replayed once more at that size
//! to confirm it (placement differs with the pool size, so a larger pool is not assumed to be
//! as good).
//!
//! A failure is **capacity** when fewer slots were free in the whole pool than the request
//! needed, and **fragmentation** when enough were free but no run of them fitted the request's
//! rules (contiguity inside one segment and area, alignment).

use serde::Serialize;

use super::parse::{TraceHeader, TraceOp};
use super::replay::{Outcome, ReplayOptions, Replayer};
use super::Result;
use crate::alloc;
use crate::error::Error;
use crate::geometry::{Geometry, PoolConfig};
use crate::pool::BouncePool;
use crate::types::{AllocatorKind, PoolMode};
use crate::IO_TLB_SEGSIZE;

/// Pool-full failures of one replay, by cause.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Failures {
    /// Maps that failed with "pool full".
    pub pool_full: u64,
    /// ... with fewer free slots in the pool than the request needed.
    pub capacity: u64,
    /// ... with enough free slots but no fitting run.
    pub fragmentation: u64,
    /// Maps that failed for another reason (too large for any pool, bad masks): no pool size
    /// helps them.
    pub other_errors: u64,
    /// Maps replayed.
    pub maps: u64,
}

/// One replay at one size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SizeReport {
    /// Slots of the pool.
    pub slots: usize,
    /// Areas of the pool.
    pub areas: usize,
    /// What failed.
    #[serde(flatten)]
    pub failures: Failures,
}

/// The advice for one allocator.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Advice {
    /// The allocator.
    pub alloc: AllocatorKind,
    /// Host pool size: `--bounce slots=` (Linux's rounding applied, so the pool built is this).
    pub slots: usize,
    /// Areas of that pool.
    pub areas: usize,
    /// The guest kernel parameter value, `swiotlb=<this>` (`"slots,areas"`); `None` in iova
    /// mode.
    pub swiotlb: Option<String>,
    /// The smallest pool with no pool-full failure, in steps of one segment per area, before
    /// rounding; one step less fails (`failures_one_step_smaller` says how often).
    pub min_slots: usize,
    /// Pool-full failures with one step (one segment per area) less than `min_slots`; 0 when
    /// `min_slots` is already the smallest possible pool.
    pub failures_one_step_smaller: u64,
    /// The replay at the current size (the trace header's or the options').
    pub current: SizeReport,
    /// Replays run for this answer.
    pub replays: u32,
}

/// Where a sizing search stops: pools larger than this many slots are not tried.
pub const DEFAULT_MAX_SLOTS: usize = 1 << 20;

/// A trace loaded once and replayed at many sizes.
#[derive(Debug)]
pub struct Sizer {
    ops: Vec<(u64, TraceOp)>,
    header: Option<TraceHeader>,
    opts: ReplayOptions,
    max_slots: usize,
}

impl Sizer {
    /// Loads every operation of a trace (`ops` as a [`super::TraceReader`] yields them).
    /// `opts` gives the mode, workers, base and the current size (slots, areas); its allocator
    /// and `compare` are ignored.
    ///
    /// # Errors
    /// The first read or parse error of the trace.
    pub fn load(
        ops: impl IntoIterator<Item = Result<(u64, TraceOp)>>,
        opts: &ReplayOptions,
    ) -> Result<Self> {
        let ops: Vec<(u64, TraceOp)> = ops.into_iter().collect::<Result<_>>()?;
        // The advisor sizes one static pool; a dynamic kernel's trace answers how much it
        // grew instead (a replay's statistics).
        if let Some((line, op)) = ops.iter().find(|(_, op)| {
            op.is_dynamic() || matches!(op, TraceOp::Header(h) if h.dynamic.is_some())
        }) {
            return Err(super::TraceError::Parse {
                line: *line,
                reason: format!(
                    "{}: a dynamic-pool trace (swiotlb-kernel-trace/2); the advisor sizes \
                     static pools, replay it to see how the pools grew",
                    op.name()
                ),
            });
        }
        let header = ops.iter().find_map(|(_, op)| match op {
            TraceOp::Header(h) => Some(h.clone()),
            _ => None,
        });
        Ok(Self {
            ops,
            header,
            opts: ReplayOptions {
                compare: false,
                ..opts.clone()
            },
            max_slots: DEFAULT_MAX_SLOTS,
        })
    }

    /// Caps the search (default [`DEFAULT_MAX_SLOTS`]).
    pub fn max_slots(mut self, max: usize) -> Self {
        self.max_slots = max.max(IO_TLB_SEGSIZE);
        self
    }

    /// The trace header, if the trace has one.
    pub fn header(&self) -> Option<&TraceHeader> {
        self.header.as_ref()
    }

    fn config(&self, alloc: AllocatorKind) -> PoolConfig {
        let mut c = self.opts.pool_config(self.header.as_ref());
        c.allocator = alloc;
        c
    }

    /// The geometry the current options and header give (Linux's rounding applied).
    ///
    /// # Errors
    /// When that pool cannot be built.
    pub fn current_geometry(&self, alloc: AllocatorKind) -> Result<Geometry> {
        Ok(self.config(alloc).geometry()?)
    }

    /// One search step: the slots of one segment in every area (swiotlb), one granule (iova).
    fn step(&self, geom: &Geometry) -> usize {
        match geom.mode {
            PoolMode::Swiotlb => IO_TLB_SEGSIZE * geom.nareas,
            PoolMode::Iova => 1,
        }
    }

    /// `geom` resized to `slots` slots (a multiple of [`Sizer::step`]), areas unchanged.
    fn resized(geom: &Geometry, slots: usize) -> Geometry {
        let mut g = *geom;
        g.nslabs = slots;
        g.area_nslabs = slots / g.nareas;
        if g.mode == PoolMode::Iova {
            g.segsize = slots;
        }
        g
    }

    /// Replays the whole trace through `alloc` on a pool of geometry `geom` and counts the
    /// pool-full failures by cause.
    ///
    /// # Errors
    /// When the pool cannot be built.
    pub fn replay(&self, alloc: AllocatorKind, geom: &Geometry) -> Result<SizeReport> {
        let allocator = alloc::build(alloc, geom)?;
        let pool = BouncePool::with_allocator(*geom, allocator, self.config(alloc).copy_on_map)?;
        // The starting area indices of a capture only mean something in a pool whose areas
        // hold them.
        let mut header = self.header.clone();
        if let Some(h) = header.as_mut() {
            if h.area_index_at_start
                .as_ref()
                .is_some_and(|i| i.len() != geom.nareas || i.iter().any(|&x| x >= geom.area_nslabs))
            {
                h.area_index_at_start = None;
            }
        }
        let mut r = Replayer::with_pool(pool, false, header.as_ref());
        let mut f = Failures::default();
        let mut mismatches = Vec::new();
        let slot = geom.slot_size();
        for (line, op) in &self.ops {
            match r.apply(*line, op, &mut mismatches) {
                Outcome::Mapped { .. } => f.maps += 1,
                Outcome::MapFailed {
                    error: Error::PoolFull { size, total, used },
                    ..
                } => {
                    f.maps += 1;
                    f.pool_full += 1;
                    let need = (size as u64).div_ceil(slot);
                    if (total.saturating_sub(used) as u64) < need {
                        f.capacity += 1;
                    } else {
                        f.fragmentation += 1;
                    }
                }
                Outcome::MapFailed { .. } => {
                    f.maps += 1;
                    f.other_errors += 1;
                }
                _ => {}
            }
        }
        Ok(SizeReport {
            slots: geom.nslabs,
            areas: geom.nareas,
            failures: f,
        })
    }

    /// Finds the smallest pool for `alloc` with no pool-full failure.
    ///
    /// # Errors
    /// When a pool cannot be built, or no pool up to the cap avoids every failure.
    pub fn advise(&self, alloc: AllocatorKind) -> Result<Advice> {
        let cur = self.current_geometry(alloc)?;
        let current = self.replay(alloc, &cur)?;
        let mut replays = 1;
        let step = self.step(&cur);
        let full = |this: &Self, slots: usize| -> Result<u64> {
            Ok(this
                .replay(alloc, &Self::resized(&cur, slots))?
                .failures
                .pool_full)
        };
        // From the current size (a whole number of steps: Linux's rounding makes it a power of
        // two of at least one segment per area), double until a replay has no failure.
        let mut hi = cur.nslabs.next_multiple_of(step);
        if current.failures.pool_full != 0 {
            loop {
                hi = hi
                    .checked_mul(2)
                    .filter(|&s| s <= self.max_slots)
                    .ok_or_else(|| {
                        Error::Config(format!(
                            "no pool up to {} slots replays this trace without \"buffer full\"",
                            self.max_slots
                        ))
                    })?;
                replays += 1;
                if full(self, hi)? == 0 {
                    break;
                }
            }
        }
        // Bisect in steps: `lo` failed (or is 0), `hi` did not.
        let mut lo = 0;
        let mut lo_failures = 0;
        while hi - lo > step {
            let mid = lo + (hi - lo) / step / 2 * step;
            replays += 1;
            let n = full(self, mid)?;
            if n == 0 {
                hi = mid;
            } else {
                lo = mid;
                lo_failures = n;
            }
        }
        let min_slots = hi;
        // What Linux and PoolConfig make of it, confirmed by one more replay (and grown by
        // doublings if a rounded pool places differently enough to fail).
        let mut cfg = self.config(alloc);
        cfg.slots = min_slots;
        cfg.areas = Some(cur.nareas);
        let mut rounded = cfg.geometry()?;
        loop {
            replays += 1;
            if self.replay(alloc, &rounded)?.failures.pool_full == 0 {
                break;
            }
            cfg.slots = rounded
                .nslabs
                .checked_mul(2)
                .filter(|&s| s <= self.max_slots)
                .ok_or_else(|| Error::Config("rounded pool size overflows the cap".into()))?;
            rounded = cfg.geometry()?;
        }
        Ok(Advice {
            alloc,
            slots: rounded.nslabs,
            areas: rounded.nareas,
            swiotlb: (cur.mode == PoolMode::Swiotlb)
                .then(|| format!("{},{}", rounded.nslabs, rounded.nareas)),
            min_slots,
            failures_one_step_smaller: lo_failures,
            current,
            replays,
        })
    }

    /// The same pool as the current one (areas, base, allocator) with `slots` slots, for
    /// checking an answer: `slots` must be a multiple of one segment per area.
    ///
    /// # Errors
    /// When the current pool cannot be built or `slots` is not a whole number of steps.
    pub fn geometry_with_slots(&self, alloc: AllocatorKind, slots: usize) -> Result<Geometry> {
        let cur = self.current_geometry(alloc)?;
        let step = self.step(&cur);
        if slots == 0 || slots % step != 0 {
            return Err(Error::Config(format!(
                "{slots} slots is not a positive multiple of {step}"
            ))
            .into());
        }
        Ok(Self::resized(&cur, slots))
    }
}
