//! The bounce library's own cost per mapping (the 2012 seed's question: what does a map cost
//! once address translation is gone?). One thread maps `size` bytes to the device and unmaps
//! them, over and over, through a fresh pool of the default geometry with time accounting on;
//! the sample is the wall time per map+unmap pair and the pool's own p50 of map and unmap
//! calls. Address arithmetic in the pool is O(1) (a slot index times the slot size, no
//! virtual-to-physical translation call): what is left is allocation and the copy.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bounce::{
    AllocatorKind, BouncePool, Direction, DynamicConfig, HostMemory, MapRequest, PoolConfig,
    PoolMode,
};

use crate::{Error, Result, Sample};

/// Guest-physical base the frames are said to live at.
const ORIG: u64 = 0x1_0000_0000;

/// One sample: map + unmap pairs of `size` bytes for `dur`, through a dynamic pool when
/// `dynamic` (its maps hit the default pool: the dynamic fast path).
///
/// # Errors
/// [`Error::Run`] when the pool cannot be built or a map fails.
pub fn measure(
    mode: PoolMode,
    alloc: AllocatorKind,
    size: usize,
    dynamic: bool,
    dur: Duration,
) -> Result<Sample> {
    let mut cfg = match mode {
        PoolMode::Swiotlb => PoolConfig::swiotlb(PoolConfig::DEFAULT_SLOTS),
        PoolMode::Iova => PoolConfig::iova(PoolConfig::DEFAULT_SLOTS),
    };
    cfg.allocator = alloc;
    cfg.workers = 1;
    if dynamic {
        // The window a device's `--bounce dynamic=on` gets by default.
        cfg.dynamic = Some(DynamicConfig::host(
            PoolConfig::DEFAULT_SLOTS.saturating_mul(DynamicConfig::DEFAULT_WINDOW_FACTOR),
        ));
    }
    let pool = BouncePool::new(&cfg).map_err(|e| Error::Run(format!("{alloc}: {e}")))?;
    let mut buf = vec![0x5au8; size];
    let mem = HostMemory::new(ORIG, &mut buf);
    let req = MapRequest::new(ORIG, size, Direction::ToDevice).worker(0);
    // Half the window untimed (the wall time per pair, without the accounting's own cost),
    // half with the pool's time accounting on (its p50 per call).
    pool.set_timing(false);
    let (pairs, elapsed) = pairs_for(&pool, &mem, &req, dur / 2)?;
    pool.set_timing(true);
    pool.reset_hiwater();
    let (timed, _) = pairs_for(&pool, &mem, &req, dur / 2)?;
    let stats = pool.stats();
    let pool_json = serde_json::to_value(&stats).ok();
    let mut m = BTreeMap::new();
    m.insert(
        "pair_ns".into(),
        elapsed.as_nanos() as f64 / pairs.max(1) as f64,
    );
    let detail = serde_json::json!({ "pairs": pairs, "seconds": elapsed.as_secs_f64() });
    Ok(Sample::with_pool(m, pool_json, timed as f64, Some(detail)))
}

/// Map + unmap `req` until `dur` has passed (or Ctrl-C); pairs done and the time taken.
fn pairs_for(
    pool: &BouncePool,
    mem: &HostMemory<'_>,
    req: &MapRequest,
    dur: Duration,
) -> Result<(u64, Duration)> {
    let start = Instant::now();
    let mut pairs = 0u64;
    while start.elapsed() < dur && !bounce_tools::report::stopped() {
        // 256 pairs between clock reads.
        for _ in 0..256 {
            let m = pool
                .map(mem, req)
                .map_err(|e| Error::Run(format!("map of {} bytes: {e}", req.size)))?;
            pool.unmap(mem, &m, 0)
                .map_err(|e| Error::Run(format!("unmap: {e}")))?;
        }
        pairs += 256;
    }
    Ok((pairs, start.elapsed()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dynamic_pool_serves_the_pairs_from_its_default_pool() {
        let dur = Duration::from_millis(20);
        let s = measure(PoolMode::Swiotlb, AllocatorKind::Areas, 1500, true, dur).unwrap();
        let pool = s.pool.expect("pool statistics");
        let d = &pool["dynamic"];
        assert_eq!(d["pools"].as_array().unwrap().len(), 1, "{d}");
        assert_eq!(d["transient_pools"], 0, "{d}");
        assert!(pool["maps"].as_u64().unwrap() > 0, "{pool}");
        let s = measure(PoolMode::Swiotlb, AllocatorKind::Areas, 1500, false, dur).unwrap();
        assert!(s.pool.unwrap().get("dynamic").is_none());
    }
}
