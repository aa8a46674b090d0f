//! Host-level block samples: a fresh `bouncevm-vhost blk` per sample (so each sample's pool
//! statistics are its own) on a raw image in tmpfs (`/dev/shm`: the seeds used RAM-backed
//! devices), opened `cache=none` with io_uring, driven in-process by the load generator
//! ([`bouncevm_load::run`], the library behind `bouncevm-load`).
//!
//! Per sample: IOPS and MB/s (read or write, whichever the pattern does), the backend's CPU time
//! per I/O (user + system of all its threads, `/proc/PID/stat`), and from its statistics socket
//! the pool's lock wait per I/O and p50 map/unmap times.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::host::{self, BackendPaths, WorkDir};
use crate::{backend_pool, Error, Result, Sample, Workload};
use bouncevm_load::LoadConfig;

/// Image size (bytes) of a full run and of `--quick`.
const IMAGE_BYTES: u64 = 256 << 20;
const QUICK_IMAGE_BYTES: u64 = 32 << 20;

/// Drives `bouncevm-vhost blk` samples.
#[derive(Debug)]
pub struct BlockDriver {
    vhost: PathBuf,
    work: WorkDir,
    image: PathBuf,
}

impl BlockDriver {
    /// Checks the backend binary and writes the image (every byte, so reads hit real pages).
    ///
    /// # Errors
    /// [`Error::Missing`] without the binary, [`Error::Os`] when the image cannot be written.
    pub fn new(vhost: &Path, quick: bool) -> Result<Self> {
        host::require_binary(vhost)?;
        let base = Path::new("/dev/shm");
        let base = if base.is_dir() {
            base.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        let work = WorkDir::new(&base, "blk")?;
        let image = work.path("disk.raw");
        let size = if quick {
            QUICK_IMAGE_BYTES
        } else {
            IMAGE_BYTES
        };
        let os = |source| Error::Os {
            what: format!("cannot write {}", image.display()),
            source,
        };
        let mut f = std::fs::File::create(&image).map_err(os)?;
        let chunk = vec![0x5au8; 1 << 20];
        for _ in 0..size / chunk.len() as u64 {
            f.write_all(&chunk).map_err(os)?;
        }
        f.sync_all().map_err(os)?;
        Ok(Self {
            vhost: vhost.to_path_buf(),
            work,
            image,
        })
    }

    /// One sample of `w` (a [`Workload::Block`]) for `dur`.
    ///
    /// # Errors
    /// The backend's or the load generator's failure.
    pub fn measure(&mut self, w: &Workload, dur: Duration) -> Result<Sample> {
        let Workload::Block {
            bounce,
            rw,
            bs,
            iodepth,
            numjobs,
            queues,
        } = w
        else {
            return Err(Error::Run("not a block workload".into()));
        };
        let paths = BackendPaths::new(&self.work, "blk");
        let q = queues.to_string();
        let image = self.image.to_string_lossy();
        let extra = [
            "--file",
            &image,
            "--format",
            "raw",
            "--cache",
            "none",
            "--aio",
            "io_uring",
            "--queues",
            &q,
            "--queue-size",
            "1024",
        ];
        let argv = paths.argv(&self.vhost, "blk", bounce, &extra);
        let mut backend = paths.spawn("bouncevm-vhost blk", &argv)?;
        let cfg = LoadConfig {
            rw: *rw,
            bs: *bs,
            iodepth: *iodepth,
            numjobs: *numjobs,
            runtime: Some(dur),
            timeout: Duration::from_secs(10),
            ..LoadConfig::new(paths.sock.clone())
        };
        let cpu0 = backend.cpu_ns();
        let report = bouncevm_load::run(&cfg).map_err(|e| match backend.running() {
            true => Error::Load(e),
            false => Error::Run(format!("backend died: {e}: {}", backend.log_tail())),
        })?;
        let cpu1 = backend.cpu_ns();
        let st = host::stats(&paths.stats, false)?;
        backend.stop();
        let dir = report
            .total
            .read
            .as_ref()
            .or(report.total.write.as_ref())
            .ok_or_else(|| Error::Run("the load generator completed no I/O".into()))?;
        let ios = dir.ios as f64;
        let mut m = BTreeMap::new();
        m.insert("iops".into(), dir.iops);
        m.insert("mbps".into(), dir.bw_bytes / 1e6);
        if let (Some(a), Some(b)) = (cpu0, cpu1) {
            if ios > 0.0 {
                m.insert(
                    "cpu_us_per_io".into(),
                    b.saturating_sub(a) as f64 / 1e3 / ios,
                );
            }
        }
        let detail = serde_json::to_value(&report).ok();
        Ok(Sample::with_pool(m, backend_pool(&st), ios, detail))
    }
}
