//! Device options shared by `bouncevm` and `bouncevm-vhost`: the bounce option string
//! (`-bounce` / `--bounce`) and the pool it builds, MAC addresses ([`parse_mac`]) and the
//! virtio-blk queue limit ([`MAX_BLK_QUEUES`]).
//!
//! The bounce option is a comma-separated list of `key=value` pairs:
//!
//! ```text
//! policy=off|force|mask=BITS   when buffers are bounced (default: force)
//! mode=swiotlb|iova            pool semantics (default: swiotlb)
//! slots=N                      pool slots (swiotlb) or 4 KiB granules (iova); default 32768
//! areas=N                      swiotlb areas (default: one per worker)
//! alloc=NAME                   allocator (default: areas for swiotlb, iova-rcache for iova)
//! workers=N                    workers (CPUs in Linux) the pool is sized for (default: the
//!                              device's queue workers)
//! on-full=wait|fail            a block request that finds the pool full while others are in
//!                              flight waits for their slots (default) or fails with IOERR
//! copy-on-map=always|when-device-reads
//!                              what map copies in: the original whatever the direction
//!                              (swiotlb's rule since its 2022 info-leak fix, the default
//!                              in swiotlb mode) or only what the device reads (VDUSE's,
//!                              the default in iova mode)
//! timing=on|off                the pool's time accounting (map/copy/unmap histograms from
//!                              the TSC; default on); off saves the clock reads and the
//!                              sampling check of every call
//! timing-every=N               time one call in N of each kind per thread (default 16;
//!                              1 times every call); call counts stay exact either way
//! dynamic=on|off               Linux's dynamic pools (CONFIG_SWIOTLB_DYNAMIC): a map the
//!                              pool cannot serve gets a transient pool of its own and a
//!                              background worker adds pools (swiotlb mode, alloc=areas;
//!                              default off)
//! dynamic-slots=N              with dynamic=on: the slots all pools may take together,
//!                              the default pool included (default 8 times the pool's)
//! pool=NAME                    the device maps through the pool NAME, shared with every
//!                              other device that names it (default: a pool of its own)
//! ```
//!
//! **Shared pools.** Devices whose options say the same `pool=NAME` share one
//! [`BouncePool`], as every device of a Linux guest shares its default swiotlb pool: one
//! allocator, one set of slots, so a NIC's receive buffers and a disk's reads compete for
//! them. Without `pool=` a device has a pool of its own, as with a `restricted-dma-pool` or
//! crosvm's `--swiotlb`. The pool keys (`mode`, `slots`, `areas`, `alloc`, `workers`,
//! `copy-on-map`, `timing`, `timing-every`, `dynamic`, `dynamic-slots`) describe the pool:
//! every device that names one pool must resolve them to the same values (a device's
//! `workers` defaults to its own queue count, so devices with different queue counts give
//! `workers=` explicitly), else building the second device fails naming the keys that differ
//! ([`crate::pools::PoolRegistry`]). `policy` and `on-full` stay each device's own.
//!
//! A dynamic pool's statistics carry a `dynamic` section: `io_tlb_nslabs` and
//! `io_tlb_transient_nslabs` as Linux's debugfs shows them, the pools (default and added,
//! newest first), transient pools made and live, growth requests and worker runs.
//!
//! ```
//! use devices::options::BounceOptions;
//! let o: BounceOptions = "policy=force,slots=4096,alloc=legacy".parse().unwrap();
//! let cfg = o.pool_config(2);
//! assert_eq!((cfg.slots, cfg.workers, cfg.allocator.name()), (4096, 2, "legacy"));
//! ```

use std::str::FromStr;
use std::sync::Arc;

use crate::block::io::OnFull;
use bounce::{AllocatorKind, BouncePool, CopyOnMap, Dma, Policy, PoolConfig, PoolMode};

/// Errors of option parsing and of building a pool from options.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OptionsError {
    /// An item is not `key=value`.
    #[error("'{0}' is not key=value")]
    NotKeyValue(String),
    /// An unknown key.
    #[error("unknown bounce option '{0}' (expected policy, mode, slots, areas, alloc, workers, on-full, copy-on-map, timing, timing-every, dynamic, dynamic-slots, pool)")]
    UnknownKey(String),
    /// A key given twice.
    #[error("bounce option '{0}' given twice")]
    Duplicate(String),
    /// A value that does not parse.
    #[error("bad value '{value}' for {key}: {reason}")]
    BadValue {
        /// The key.
        key: String,
        /// The value.
        value: String,
        /// Why.
        reason: String,
    },
    /// The pool could not be built.
    #[error("bounce pool: {0}")]
    Pool(String),
    /// A device names a shared pool with pool keys other than the pool's.
    #[error("bounce pool '{pool}': device '{device}' differs from device '{first}' in {differ} (every device of one pool gives the same pool keys)")]
    PoolConflict {
        /// The pool's name.
        pool: String,
        /// The device that differs.
        device: String,
        /// The device that built the pool.
        first: String,
        /// The keys that differ, `key mine against theirs`.
        differ: String,
    },
}

// Field list of the bounce options; alike in shape only to other option structs.
/// Parsed `--bounce` options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BounceOptions {
    /// When buffers are bounced.
    pub policy: Policy,
    /// Pool semantics.
    pub mode: PoolMode,
    /// Requested slots (granules in iova mode).
    pub slots: usize,
    /// Requested areas, if given.
    pub areas: Option<usize>,
    /// Allocator, if given (else the mode's default).
    pub alloc: Option<AllocatorKind>,
    /// Workers, if given (else the caller's default).
    pub workers: Option<usize>,
    /// What a block request does when the pool is momentarily full.
    pub on_full: OnFull,
    /// The copy rule on map, if given (else the mode's).
    pub copy_on_map: Option<CopyOnMap>,
    /// The pool's time accounting ([`BouncePool::set_timing`]).
    pub timing: bool,
    /// One call in how many is timed ([`BouncePool::set_timing_sample_every`]).
    pub timing_every: u32,
    /// Dynamic pools ([`bounce::dynamic`]).
    pub dynamic: bool,
    /// The slots a dynamic pool's pools may take together, if given.
    pub dynamic_slots: Option<usize>,
    /// The shared pool the device maps through, if named (else a pool of its own).
    pub pool: Option<String>,
}

impl Default for BounceOptions {
    /// What an option string that does not say otherwise means (as parsing `""`): every
    /// buffer bounced (`policy=force`) through a swiotlb pool of the default size. No option
    /// at all means no bouncing: [`BounceOptions::off`].
    fn default() -> Self {
        Self {
            policy: Policy::Force,
            mode: PoolMode::Swiotlb,
            slots: PoolConfig::DEFAULT_SLOTS,
            areas: None,
            alloc: None,
            workers: None,
            on_full: OnFull::Wait,
            copy_on_map: None,
            timing: true,
            timing_every: bounce::stats::DEFAULT_SAMPLE_EVERY,
            dynamic: false,
            dynamic_slots: None,
            pool: None,
        }
    }
}

fn on_off(value: &str) -> Result<bool, String> {
    match value {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err("expected on or off".into()),
    }
}

fn positive(key: &str, value: &str) -> Result<usize, OptionsError> {
    value
        .parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| OptionsError::BadValue {
            key: key.into(),
            value: value.into(),
            reason: "expected a positive integer".into(),
        })
}

/// The longest pool name.
const MAX_POOL_NAME: usize = 64;

/// A pool name: 1 to 64 letters, digits, `-`, `_` or `.` (no `,` or `=`, which the option
/// syntax uses, and nothing a log line or a JSON reader would stumble on).
fn pool_name(value: &str) -> Result<String, String> {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if value.is_empty() || value.len() > MAX_POOL_NAME || !value.chars().all(ok) {
        return Err(format!(
            "expected 1 to {MAX_POOL_NAME} letters, digits, '-', '_' or '.'"
        ));
    }
    Ok(value.to_string())
}

impl FromStr for BounceOptions {
    type Err = OptionsError;

    fn from_str(s: &str) -> Result<Self, OptionsError> {
        let mut o = Self::default();
        let mut seen: Vec<&str> = Vec::new();
        for item in s.split(',').filter(|i| !i.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| OptionsError::NotKeyValue(item.into()))?;
            if seen.contains(&key) {
                return Err(OptionsError::Duplicate(key.into()));
            }
            let bad = |reason: String| OptionsError::BadValue {
                key: key.into(),
                value: value.into(),
                reason,
            };
            match key {
                "policy" => {
                    o.policy = value
                        .parse()
                        .map_err(|e: bounce::Error| bad(e.to_string()))?
                }
                "mode" => {
                    o.mode = value
                        .parse()
                        .map_err(|e: bounce::Error| bad(e.to_string()))?
                }
                "alloc" => {
                    o.alloc = Some(
                        value
                            .parse()
                            .map_err(|e: bounce::Error| bad(e.to_string()))?,
                    )
                }
                "slots" => o.slots = positive(key, value)?,
                "areas" => o.areas = Some(positive(key, value)?),
                "workers" => o.workers = Some(positive(key, value)?),
                "on-full" => o.on_full = value.parse().map_err(bad)?,
                "copy-on-map" => {
                    o.copy_on_map = Some(
                        value
                            .parse()
                            .map_err(|e: bounce::Error| bad(e.to_string()))?,
                    )
                }
                "timing" => o.timing = on_off(value).map_err(bad)?,
                "dynamic" => o.dynamic = on_off(value).map_err(bad)?,
                "dynamic-slots" => o.dynamic_slots = Some(positive(key, value)?),
                "pool" => o.pool = Some(pool_name(value).map_err(bad)?),
                "timing-every" => {
                    o.timing_every = positive(key, value)?
                        .try_into()
                        .map_err(|_| bad(format!("at most {}", u32::MAX)))?
                }
                _ => return Err(OptionsError::UnknownKey(key.into())),
            }
            seen.push(key);
        }
        if o.dynamic_slots.is_some() && !o.dynamic {
            return Err(OptionsError::BadValue {
                key: "dynamic-slots".into(),
                value: o.dynamic_slots.unwrap_or(0).to_string(),
                reason: "needs dynamic=on".into(),
            });
        }
        Ok(o)
    }
}

impl BounceOptions {
    /// No bouncing: what a device gets when no bounce option names it.
    pub fn off() -> Self {
        Self {
            policy: Policy::Off,
            ..Self::default()
        }
    }

    /// The pool configuration, with `default_workers` when `workers` was not given.
    pub fn pool_config(&self, default_workers: usize) -> PoolConfig {
        let mut c = match self.mode {
            PoolMode::Swiotlb => PoolConfig::swiotlb(self.slots),
            PoolMode::Iova => PoolConfig::iova(self.slots),
        };
        c.workers = self.workers.unwrap_or(default_workers).max(1);
        if let Some(a) = self.areas {
            c.areas = Some(a);
        }
        if let Some(k) = self.alloc {
            c.allocator = k;
        }
        c.copy_on_map = self.copy_on_map;
        if self.dynamic {
            // The pool's slots as Linux rounds them (a configuration that does not resolve
            // fails when the pool is built).
            let default = c.geometry().map_or(c.slots, |g| g.nslabs);
            let window = self
                .dynamic_slots
                .unwrap_or(default.saturating_mul(bounce::DynamicConfig::DEFAULT_WINDOW_FACTOR));
            c.dynamic = Some(bounce::DynamicConfig::host(window));
        }
        c
    }

    /// The pool keys resolved for `default_workers` (see [`BounceOptions::pool_config`]), as
    /// `(key, value)` in option order: what every device sharing one pool must agree on.
    pub fn pool_settings(&self, default_workers: usize) -> Vec<(&'static str, String)> {
        let c = self.pool_config(default_workers);
        let on_off = |b: bool| if b { "on" } else { "off" }.to_string();
        let dynamic_slots = match c.dynamic.map(|d| d.pages) {
            Some(bounce::PoolPages::Host { slots }) => slots.to_string(),
            Some(other) => format!("{other:?}"),
            None => "none".into(),
        };
        vec![
            ("mode", c.mode.to_string()),
            ("slots", c.slots.to_string()),
            (
                "areas",
                c.areas
                    .map_or_else(|| "one per worker".into(), |a| a.to_string()),
            ),
            ("alloc", c.allocator.to_string()),
            ("workers", c.workers.to_string()),
            (
                "copy-on-map",
                c.copy_on_map
                    .map_or_else(|| "the mode's".into(), |r| r.to_string()),
            ),
            ("timing", on_off(self.timing)),
            ("timing-every", self.timing_every.to_string()),
            ("dynamic", on_off(self.dynamic)),
            ("dynamic-slots", dynamic_slots),
        ]
    }

    /// Builds the DMA handle: direct for policy `off`, else bounced through a new pool.
    ///
    /// # Errors
    /// [`OptionsError::Pool`] when the pool cannot be built.
    pub fn build(
        &self,
        default_workers: usize,
    ) -> Result<(Dma, Option<Arc<BouncePool>>), OptionsError> {
        if self.policy == Policy::Off {
            return Ok((Dma::direct(), None));
        }
        let pool = BouncePool::new(&self.pool_config(default_workers))
            .map_err(|e| OptionsError::Pool(e.to_string()))?;
        pool.set_timing(self.timing);
        pool.set_timing_sample_every(self.timing_every);
        let pool = Arc::new(pool);
        Ok((Dma::bounced(self.policy, pool.clone()), Some(pool)))
    }
}

/// The most request queues of a virtio-blk device (`virtio-blk-pci`'s `num-queues=`,
/// `bouncevm-vhost blk --queues`).
pub const MAX_BLK_QUEUES: u16 = 64;

/// Parses a MAC address: six two-digit hex bytes separated by `:` or `-` (QEMU accepts
/// both); the one MAC parser of both binaries.
pub fn parse_mac(s: &str) -> std::result::Result<[u8; 6], String> {
    let bad = || format!("'{s}' is not a MAC address (six hex bytes separated by ':' or '-')");
    let sep = if s.contains('-') { '-' } else { ':' };
    let parts: Vec<&str> = s.split(sep).collect();
    if parts.len() != 6 {
        return Err(bad());
    }
    let mut mac = [0u8; 6];
    for (m, p) in mac.iter_mut().zip(parts) {
        if p.len() != 2 {
            return Err(bad());
        }
        *m = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    Ok(mac)
}

/// Formats a MAC address as `52:54:00:12:34:56`.
pub fn format_mac(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_option_string_parses() {
        let o: BounceOptions =
            "policy=mask=32,mode=iova,slots=1024,areas=4,alloc=genpool,workers=3"
                .parse()
                .unwrap();
        assert_eq!(o.policy, Policy::Mask(32));
        assert_eq!(o.mode, PoolMode::Iova);
        let c = o.pool_config(1);
        assert_eq!(c.slots, 1024);
        assert_eq!(c.areas, Some(4));
        assert_eq!(c.allocator, AllocatorKind::Genpool);
        assert_eq!(c.workers, 3);
        assert_eq!(c.base, PoolConfig::DEFAULT_IOVA_BASE);
    }

    #[test]
    fn defaults_are_force_swiotlb_with_the_callers_workers() {
        let o: BounceOptions = "".parse().unwrap();
        assert_eq!(o.policy, Policy::Force);
        let c = o.pool_config(4);
        assert_eq!(c.mode, PoolMode::Swiotlb);
        assert_eq!(c.slots, PoolConfig::DEFAULT_SLOTS);
        assert_eq!(c.workers, 4);
        assert_eq!(c.allocator, AllocatorKind::Areas);
        let iova = "mode=iova".parse::<BounceOptions>().unwrap().pool_config(1);
        assert_eq!(iova.allocator, AllocatorKind::IovaRcache);
    }

    #[test]
    fn dynamic_pools_are_an_option() {
        let o: BounceOptions = "slots=1000,areas=2,dynamic=on".parse().unwrap();
        let c = o.pool_config(1);
        // The window holds eight default pools of the rounded 1024 slots.
        assert_eq!(
            c.dynamic.map(|d| d.pages),
            Some(bounce::PoolPages::Host { slots: 8192 })
        );
        let (dma, pool) = o.build(1).unwrap();
        let pool = pool.unwrap();
        assert!(pool.dynamic().is_some());
        let stats = dma.stats().unwrap();
        let d = stats.dynamic.as_ref().expect("dynamic statistics");
        assert_eq!(
            (d.io_tlb_nslabs, d.default_nareas, d.pools.len()),
            (1024, 2, 1)
        );
        let json = stats.to_json();
        assert!(json.contains("\"io_tlb_transient_nslabs\":0"), "{json}");
        let sized: BounceOptions = "dynamic=on,dynamic-slots=4096".parse().unwrap();
        assert_eq!(
            sized.pool_config(1).dynamic.map(|d| d.pages),
            Some(bounce::PoolPages::Host { slots: 4096 })
        );
        let off: BounceOptions = "dynamic=off".parse().unwrap();
        assert_eq!(off.pool_config(1).dynamic, None);
        assert!(""
            .parse::<BounceOptions>()
            .unwrap()
            .build(1)
            .unwrap()
            .1
            .unwrap()
            .dynamic()
            .is_none());
        let e = |s: &str| s.parse::<BounceOptions>().unwrap_err();
        assert!(matches!(e("dynamic=yes"), OptionsError::BadValue { .. }));
        assert!(e("dynamic-slots=4096")
            .to_string()
            .contains("needs dynamic=on"));
        let build = |s: &str| s.parse::<BounceOptions>().unwrap().build(1).map(|_| ());
        assert!(build("dynamic=on,mode=iova").is_err());
        assert!(build("dynamic=on,alloc=magazine").is_err());
        assert!(build("dynamic=on,slots=4096,dynamic-slots=128").is_err());
    }

    #[test]
    fn bad_options_say_what_is_wrong() {
        let e = |s: &str| s.parse::<BounceOptions>().unwrap_err();
        assert_eq!(e("colour=red"), OptionsError::UnknownKey("colour".into()));
        assert_eq!(e("slots"), OptionsError::NotKeyValue("slots".into()));
        assert_eq!(
            e("slots=1,slots=2"),
            OptionsError::Duplicate("slots".into())
        );
        assert!(matches!(e("slots=0"), OptionsError::BadValue { .. }));
        assert!(matches!(e("slots=-3"), OptionsError::BadValue { .. }));
        assert!(matches!(e("alloc=best"), OptionsError::BadValue { .. }));
        assert!(matches!(e("mode=dma"), OptionsError::BadValue { .. }));
        assert!(matches!(e("policy=mask=99"), OptionsError::BadValue { .. }));
        assert!(e("alloc=best").to_string().contains("areas-bitmap"));
    }

    #[test]
    fn the_default_is_what_an_empty_option_string_means_and_no_option_is_off() {
        let empty: BounceOptions = "".parse().unwrap();
        assert_eq!(empty, BounceOptions::default());
        assert_eq!(empty.policy, Policy::Force);
        let sized: BounceOptions = "slots=1024".parse().unwrap();
        assert_eq!(sized.policy, Policy::Force);
        assert_eq!(BounceOptions::off().policy, Policy::Off);
        assert_eq!(
            BounceOptions {
                policy: Policy::Force,
                ..BounceOptions::off()
            },
            BounceOptions::default()
        );
    }

    #[test]
    fn on_full_is_wait_unless_told() {
        let o: BounceOptions = "policy=force".parse().unwrap();
        assert_eq!(o.on_full, OnFull::Wait);
        assert_eq!(BounceOptions::default().on_full, OnFull::Wait);
        let o: BounceOptions = "on-full=fail".parse().unwrap();
        assert_eq!(o.on_full, OnFull::Fail);
        let e = "on-full=drop".parse::<BounceOptions>().unwrap_err();
        assert!(e.to_string().contains("wait or fail"), "{e}");
    }

    #[test]
    fn copy_on_map_is_the_modes_unless_told_and_reaches_the_pool() {
        let rule = |s: &str| {
            let (_, pool) = s.parse::<BounceOptions>().unwrap().build(1).unwrap();
            let pool = pool.unwrap();
            assert_eq!(pool.stats().copy_on_map, pool.copy_on_map());
            pool.copy_on_map()
        };
        assert_eq!(rule("slots=64"), CopyOnMap::Always);
        assert_eq!(rule("mode=iova,slots=64"), CopyOnMap::WhenDeviceReads);
        assert_eq!(
            rule("mode=iova,slots=64,copy-on-map=always"),
            CopyOnMap::Always
        );
        assert_eq!(
            rule("slots=64,copy-on-map=when-device-reads"),
            CopyOnMap::WhenDeviceReads
        );
        let e = "copy-on-map=never".parse::<BounceOptions>().unwrap_err();
        assert!(e.to_string().contains("always or when-device-reads"), "{e}");
        let e = "copy-in=always".parse::<BounceOptions>().unwrap_err();
        assert!(e.to_string().contains("copy-on-map"), "{e}");
    }

    /// The time-accounting statistics of the pool an option string builds.
    fn timing_of(s: &str) -> bounce::stats::TimingStats {
        let o: BounceOptions = s.parse().unwrap();
        let (_, pool) = o.build(1).unwrap();
        pool.unwrap().stats().timing
    }

    #[test]
    fn timing_is_on_unless_told_and_reaches_the_pool() {
        let stats = |s: &str| timing_of(s).enabled;
        assert!(stats("slots=64"));
        assert!(stats("slots=64,timing=on"));
        assert!(!stats("slots=64,timing=off"));
        let e = "timing=maybe".parse::<BounceOptions>().unwrap_err();
        assert!(e.to_string().contains("on or off"), "{e}");
    }

    #[test]
    fn timing_every_reaches_the_pool() {
        let every = |s: &str| timing_of(s).sample_every;
        assert_eq!(every("slots=64"), bounce::stats::DEFAULT_SAMPLE_EVERY);
        assert_eq!(every("slots=64,timing-every=1"), 1);
        assert_eq!(every("slots=64,timing-every=1000"), 1000);
        for bad in [
            "timing-every=0",
            "timing-every=x",
            "timing-every=4294967296",
        ] {
            let e = bad.parse::<BounceOptions>().unwrap_err();
            assert!(e.to_string().contains("timing-every"), "{bad}: {e}");
        }
    }

    #[test]
    fn pool_names_a_shared_pool_and_is_checked() {
        let o: BounceOptions = "pool=swiotlb-0,slots=512".parse().unwrap();
        assert_eq!(o.pool.as_deref(), Some("swiotlb-0"));
        assert_eq!(BounceOptions::default().pool, None);
        let long = format!("pool={}", "p".repeat(MAX_POOL_NAME));
        assert!(long.parse::<BounceOptions>().is_ok());
        for bad in [
            "pool=",
            "pool=a b",
            "pool=x/y",
            "pool=é",
            &format!("{long}p"),
        ] {
            let e = bad.parse::<BounceOptions>().unwrap_err();
            assert!(e.to_string().contains("letters, digits"), "{bad}: {e}");
        }
        assert_eq!(
            "pool=a,pool=b".parse::<BounceOptions>().unwrap_err(),
            OptionsError::Duplicate("pool".into())
        );
        assert!(e_unknown().contains("pool)"));
    }

    fn e_unknown() -> String {
        "colour=red"
            .parse::<BounceOptions>()
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn pool_settings_are_the_resolved_pool_keys() {
        let o: BounceOptions = "slots=1000,alloc=legacy,policy=mask=32,on-full=fail"
            .parse()
            .unwrap();
        let s = o.pool_settings(2);
        let get = |k: &str| s.iter().find(|(key, _)| *key == k).unwrap().1.clone();
        assert_eq!(
            (get("mode"), get("slots"), get("alloc"), get("workers")),
            ("swiotlb".into(), "1000".into(), "legacy".into(), "2".into())
        );
        assert_eq!((get("timing"), get("dynamic")), ("on".into(), "off".into()));
        // Device keys are not pool keys.
        assert!(s
            .iter()
            .all(|(k, _)| !matches!(*k, "policy" | "on-full" | "pool")));
        let d: BounceOptions = "dynamic=on,dynamic-slots=4096".parse().unwrap();
        let s = d.pool_settings(1);
        assert!(s.contains(&("dynamic-slots", "4096".into())), "{s:?}");
    }

    #[test]
    fn policy_off_needs_no_pool() {
        let o: BounceOptions = "policy=off".parse().unwrap();
        let (dma, pool) = o.build(1).unwrap();
        assert_eq!(dma.policy(), Policy::Off);
        assert!(pool.is_none());
    }
}
