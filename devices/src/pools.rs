//! The bounce pools of one process: a pool of its own for each device, or one pool shared by
//! every device whose bounce options name it (`pool=NAME`, see [`crate::options`]).
//!
//! [`PoolRegistry::dma`] gives each device its DMA handle, with counters of its own
//! ([`bounce::DmaCounters`]) so that the statistics say what each device cost a shared pool;
//! [`PoolRegistry::pools_json`] lists the shared pools once each, with their devices and the
//! pool's statistics. A device's own statistics ([`bounce_json`], [`dma_json`]) carry its
//! pool's statistics only when the pool is its own.
//!
//! Sharing a pool shares its slots, never a mapping: a device reaches the pool only through
//! its [`Dma`] handle, which unmaps and accesses only the [`bounce::DmaBuffer`]s its own maps
//! returned; bounce addresses never leave the process (a guest or a front end names guest
//! addresses only), and an unmap of an address that is no live mapping is refused and counted
//! by the pool ([`bounce::Error::NotMapped`]).
//!
//! ```
//! use devices::options::BounceOptions;
//! use devices::pools::PoolRegistry;
//! let mut pools = PoolRegistry::default();
//! let o: BounceOptions = "pool=shared,slots=4096".parse().unwrap();
//! let (_, disk) = pools.dma("disk0", &o, 1).unwrap();
//! let (_, nic) = pools.dma("net0", &o, 1).unwrap();
//! assert!(std::sync::Arc::ptr_eq(&disk.unwrap(), &nic.unwrap()));
//! let bigger: BounceOptions = "pool=shared,slots=8192".parse().unwrap();
//! let e = pools.dma("net1", &bigger, 1).unwrap_err().to_string();
//! assert!(e.contains("slots 8192 against 4096"), "{e}");
//! ```

use std::sync::Arc;

use bounce::{BouncePool, Dma, DmaCounters};
use serde_json::{json, Value};

use crate::options::{BounceOptions, OptionsError};

/// A pool named by `pool=NAME`.
#[derive(Debug)]
struct NamedPool {
    name: String,
    /// The pool keys it was built with ([`BounceOptions::pool_settings`]).
    settings: Vec<(&'static str, String)>,
    /// The devices that map through it, first the one that built it.
    devices: Vec<String>,
    pool: Arc<BouncePool>,
}

/// The pools of one process (see the module documentation).
#[derive(Debug, Default)]
pub struct PoolRegistry {
    named: Vec<NamedPool>,
}

impl PoolRegistry {
    /// The DMA handle of `device` for its options `bounce`: direct for policy `off`; else
    /// counted ([`Dma::with_counters`]) and bounced through the pool `bounce.pool` names
    /// (built by the first device that names it) or through a new pool of its own.
    /// `default_workers` is the device's queue count, the `workers` of its pool when the
    /// options do not say.
    ///
    /// # Errors
    /// [`OptionsError::Pool`] when a pool cannot be built; [`OptionsError::PoolConflict`]
    /// when the pool exists with other pool keys.
    pub fn dma(
        &mut self,
        device: &str,
        bounce: &BounceOptions,
        default_workers: usize,
    ) -> Result<(Dma, Option<Arc<BouncePool>>), OptionsError> {
        let (dma, pool) = match &bounce.pool {
            Some(name) if bounce.policy != bounce::Policy::Off => {
                let pool = self.named(name, device, bounce, default_workers)?;
                (Dma::bounced(bounce.policy, pool.clone()), Some(pool))
            }
            _ => bounce.build(default_workers)?,
        };
        if pool.is_none() {
            return Ok((dma, None));
        }
        let counters = Arc::new(DmaCounters::new(bounce.pool.clone()));
        Ok((dma.with_counters(counters), pool))
    }

    /// The pool `name`, built now from `bounce` if no device named it yet; `device` joins it.
    fn named(
        &mut self,
        name: &str,
        device: &str,
        bounce: &BounceOptions,
        default_workers: usize,
    ) -> Result<Arc<BouncePool>, OptionsError> {
        let settings = bounce.pool_settings(default_workers);
        if let Some(p) = self.named.iter_mut().find(|p| p.name == name) {
            let differ: Vec<String> = settings
                .iter()
                .zip(&p.settings)
                .filter(|(mine, theirs)| mine.1 != theirs.1)
                .map(|((key, mine), (_, theirs))| format!("{key} {mine} against {theirs}"))
                .collect();
            if !differ.is_empty() {
                return Err(OptionsError::PoolConflict {
                    pool: name.to_string(),
                    device: device.to_string(),
                    first: p.devices.first().cloned().unwrap_or_default(),
                    differ: differ.join(", "),
                });
            }
            p.devices.push(device.to_string());
            return Ok(p.pool.clone());
        }
        let (_, pool) = bounce.build(default_workers)?;
        let pool =
            pool.ok_or_else(|| OptionsError::Pool(format!("pool '{name}' bounces nothing")))?;
        self.named.push(NamedPool {
            name: name.to_string(),
            settings,
            devices: vec![device.to_string()],
            pool: pool.clone(),
        });
        Ok(pool)
    }

    /// The names of the shared pools, in the order they were built.
    pub fn names(&self) -> Vec<&str> {
        self.named.iter().map(|p| p.name.as_str()).collect()
    }

    /// The shared pool `name`, if a device named it.
    pub fn pool(&self, name: &str) -> Option<&Arc<BouncePool>> {
        self.named.iter().find(|p| p.name == name).map(|p| &p.pool)
    }

    /// The shared pools, once each: `[{"pool": NAME, "devices": [ids], "stats": PoolStats}]`.
    pub fn pools_json(&self) -> Value {
        self.named
            .iter()
            .map(|p| json!({"pool": p.name, "devices": p.devices, "stats": p.pool.stats()}))
            .collect()
    }
}

/// The `bounce` member of a device's statistics: its pool's statistics when the pool is its
/// own, `{"pool": NAME}` when it shares the pool NAME (whose statistics
/// [`PoolRegistry::pools_json`] lists once), null when it does not bounce.
pub fn bounce_json(dma: &Dma) -> Value {
    match dma.dma_stats().and_then(|d| d.pool) {
        Some(name) => json!({ "pool": name }),
        None => json!(dma.stats()),
    }
}

/// The `dma` member of a device's statistics: the maps, bytes, full-pool failures and unmaps
/// it made through its pool ([`bounce::DmaStats`]), null when it does not bounce.
pub fn dma_json(dma: &Dma) -> Value {
    json!(dma.dma_stats())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(s: &str) -> BounceOptions {
        s.parse().unwrap()
    }

    #[test]
    fn devices_naming_one_pool_share_it_and_others_keep_their_own() {
        let mut r = PoolRegistry::default();
        let (a, pa) = r.dma("disk0", &opts("pool=p,slots=256"), 1).unwrap();
        let (b, pb) = r
            .dma(
                "net0",
                &opts("pool=p,slots=256,policy=mask=32,on-full=fail"),
                1,
            )
            .unwrap();
        let (c, pc) = r.dma("disk1", &opts("slots=256"), 1).unwrap();
        let (d, pd) = r.dma("disk2", &opts("pool=p,policy=off"), 1).unwrap();
        let (pa, pb, pc) = (pa.unwrap(), pb.unwrap(), pc.unwrap());
        assert!(Arc::ptr_eq(&pa, &pb));
        assert!(!Arc::ptr_eq(&pa, &pc));
        assert!(pd.is_none() && d.dma_stats().is_none() && d.pool().is_none());
        assert_eq!(b.policy(), bounce::Policy::Mask(32));
        assert_eq!(r.names(), ["p"]);
        assert!(Arc::ptr_eq(r.pool("p").unwrap(), &pa));
        assert!(r.pool("q").is_none());
        assert_eq!(bounce_json(&a), json!({"pool": "p"}));
        assert_eq!(bounce_json(&c)["nslabs"], 256);
        assert_eq!(bounce_json(&d), Value::Null);
        assert_eq!(dma_json(&a)["pool"], "p");
        assert_eq!(dma_json(&c)["maps"], 0);
        assert!(dma_json(&c).get("pool").is_none());
        assert_eq!(dma_json(&d), Value::Null);
        let listed = r.pools_json();
        assert_eq!(listed.as_array().unwrap().len(), 1);
        assert_eq!(listed[0]["devices"], json!(["disk0", "net0"]));
        assert_eq!(listed[0]["stats"]["nslabs"], 256);
    }

    #[test]
    fn conflicting_pool_keys_name_the_devices_and_the_keys() {
        let mut r = PoolRegistry::default();
        r.dma("disk0", &opts("pool=p,slots=256"), 2).unwrap();
        let e = r
            .dma("net0", &opts("pool=p,slots=512,alloc=legacy"), 2)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "bounce pool 'p': device 'net0' differs from device 'disk0' in slots 512 against 256, \
             alloc legacy against areas (every device of one pool gives the same pool keys)"
        );
        // A device's own queue count is its pool's default workers: they must agree too.
        let e = r.dma("net1", &opts("pool=p,slots=256"), 1).unwrap_err();
        assert!(e.to_string().contains("workers 1 against 2"), "{e}");
        r.dma("net1", &opts("pool=p,slots=256,workers=2"), 1)
            .unwrap();
        // A refused device did not join the pool.
        assert_eq!(r.pools_json()[0]["devices"], json!(["disk0", "net1"]));
        // A pool that cannot be built is the first device's error and no pool is recorded.
        assert!(matches!(
            r.dma("x", &opts("pool=bad,dynamic=on,mode=iova"), 1),
            Err(OptionsError::Pool(_))
        ));
        assert!(r.pool("bad").is_none());
    }
}
