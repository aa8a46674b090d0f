//! `bouncevm-load`: a host-speed load generator for any vhost-user-blk back end.
//!
//! It is the guest and the VMM at once: a vhost-user front end (the rust-vmm `vhost`
//! crate's [`vhost::vhost_user::Frontend`]) that shares a memfd as guest memory, negotiates
//! features as QEMU does, lays out one split virtqueue per job in that memory and drives
//! virtio-blk requests through it at a chosen depth, fio-style. Nothing in between is slowed
//! by a guest, so what it measures is the back end: ours (`bouncevm-vhost blk`, with each
//! bounce setting) side by side with qemu-storage-daemon.
//!
//! - [`session`]: the vhost-user conversation (features, config space, memory, rings).
//! - [`job`]: one job = one queue + one thread: submission up to the depth, completions in
//!   any order, the verify bookkeeping. The driver's side of its split virtqueue is
//!   [`devices::virtio::driver::DriverQueue`], each request with fixed descriptors.
//! - [`pattern`]: the verify pattern (offset + generation + run seed in every sector).
//! - [`stats`]: latency histogram and report figures.
//!
//! Every wait is bounded by [`LoadConfig::timeout`]: vhost-user replies through the socket's
//! receive timeout, completions through `poll` on the call eventfd together with the socket
//! (a back end that goes away wakes the poll with POLLRDHUP).
//!
//! ```no_run
//! use std::time::Duration;
//! use bouncevm_load::{LoadConfig, Rw};
//! let cfg = LoadConfig {
//!     rw: Rw::RandRead,
//!     iodepth: 32,
//!     runtime: Some(Duration::from_secs(5)),
//!     ..LoadConfig::new("/tmp/blk.sock".into())
//! };
//! let report = bouncevm_load::run(&cfg).unwrap();
//! println!("{}", report.total.read.as_ref().unwrap().iops);
//! ```

#![warn(missing_docs)]

pub mod job;
pub mod pattern;
pub mod session;
pub mod stats;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use devices::virtio::spec::{
    feature, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_UNSUPP, VIRTIO_RING_F_EVENT_IDX,
    VIRTIO_RING_F_INDIRECT_DESC,
};
use serde::Serialize;
use vmm_sys_util::eventfd::EventFd;

use self::job::{ring_layout, Job, JobArea, JobOutcome};
use self::session::{DeviceInfo, QueueSetup, Session, Wanted};
use self::stats::{DirReport, DirStats};

/// Largest `--iodepth`.
pub const MAX_IODEPTH: u16 = 1024;
/// Largest `--numjobs`.
pub const MAX_JOBS: u16 = 64;
/// Largest shared memory the load generator maps.
pub const MAX_MEMORY: u64 = 16 << 30;
/// Largest number of blocks a verifying job keeps a generation for.
pub const MAX_VERIFY_BLOCKS: u64 = 1 << 26;

/// Errors of a load run. Each is one line.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad options (or options the device cannot serve).
    #[error("{0}")]
    Config(String),
    /// The socket cannot be connected.
    #[error("cannot connect to {path}: {source}")]
    Connect {
        /// Socket path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A vhost-user request failed or was not answered in time.
    #[error("vhost-user {step} failed: {source}")]
    Protocol {
        /// The request.
        step: &'static str,
        /// Why.
        source: vhost::Error,
    },
    /// A vhost-user request got no answer in time (the connection is then shut down).
    #[error("vhost-user {step}: no answer from the backend in {secs} s")]
    NoAnswer {
        /// The request.
        step: &'static str,
        /// Seconds waited.
        secs: f64,
    },
    /// The back end lacks a feature the run needs.
    #[error("{0}")]
    Feature(String),
    /// Shared memory cannot be set up.
    #[error("guest memory: {0}")]
    Memory(String),
    /// The back end broke the protocol (ring, used entries, status, config).
    #[error("backend misbehaved: {0}")]
    Misbehaved(String),
    /// The back end closed the connection.
    #[error("backend disconnected (job {job}, {inflight} requests in flight)")]
    Disconnected {
        /// Job.
        job: u16,
        /// Requests outstanding.
        inflight: usize,
    },
    /// No completion within the timeout.
    #[error("job {job}: no completion in {secs} s with {inflight} requests in flight")]
    Timeout {
        /// Job.
        job: u16,
        /// Seconds waited.
        secs: f64,
        /// Requests outstanding.
        inflight: usize,
    },
    /// The back end completed a request with an error status.
    #[error("job {job}: {op} of {len} bytes at byte {offset} completed with status {status} ({})", status_name(*.status))]
    Io {
        /// Job.
        job: u16,
        /// "read" or "write".
        op: &'static str,
        /// Device byte offset.
        offset: u64,
        /// Length.
        len: u32,
        /// virtio-blk status.
        status: u8,
    },
    /// Data read back is not what was written.
    #[error("verify failed in job {job}: {mismatch}")]
    Verify {
        /// Job.
        job: u16,
        /// The first bad sector.
        mismatch: pattern::Mismatch,
    },
    /// An eventfd or poll failed.
    #[error("{what}: {source}")]
    Os {
        /// What was done.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
    /// Another job failed, so this one stopped.
    #[error("stopped because another job failed")]
    Stopped,
}

fn status_name(s: u8) -> &'static str {
    match s {
        VIRTIO_BLK_S_IOERR => "IOERR",
        VIRTIO_BLK_S_UNSUPP => "UNSUPP",
        _ => "not a virtio-blk status",
    }
}

/// Result of the load generator.
pub type Result<T> = std::result::Result<T, Error>;

/// The access pattern (fio's `--rw`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Rw {
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Random reads.
    #[value(name = "randread")]
    RandRead,
    /// Random writes.
    #[value(name = "randwrite")]
    RandWrite,
    /// Random reads and writes, `rwmixread` percent reads.
    #[value(name = "randrw")]
    RandRw,
}

impl Rw {
    /// Whether the pattern writes.
    pub fn writes(self) -> bool {
        matches!(self, Rw::Write | Rw::RandWrite | Rw::RandRw)
    }
    /// Whether the pattern reads.
    pub fn reads(self) -> bool {
        matches!(self, Rw::Read | Rw::RandRead | Rw::RandRw)
    }
    /// Whether offsets are random.
    pub fn random(self) -> bool {
        matches!(self, Rw::RandRead | Rw::RandWrite | Rw::RandRw)
    }
    /// fio's name.
    pub fn name(self) -> &'static str {
        match self {
            Rw::Read => "read",
            Rw::Write => "write",
            Rw::RandRead => "randread",
            Rw::RandWrite => "randwrite",
            Rw::RandRw => "randrw",
        }
    }
}

// Field list of the load options; alike in shape only to other option structs.
/// What to run.
#[derive(Clone, Debug)]
pub struct LoadConfig {
    /// The back end's vhost-user socket.
    pub socket: PathBuf,
    /// Access pattern.
    pub rw: Rw,
    /// Block size in bytes (a multiple of 512 and of the device's logical block size).
    pub bs: u32,
    /// Requests in flight per job.
    pub iodepth: u16,
    /// Jobs (one queue and one thread each).
    pub numjobs: u16,
    /// Run for this long (time based); `None`: one pass of `size` bytes per job.
    pub runtime: Option<Duration>,
    /// Bytes of the device used (from 0); `None`: the whole device.
    pub size: Option<u64>,
    /// Check every byte read back (see [`job`]).
    pub verify: bool,
    /// Percent of reads for [`Rw::RandRw`].
    pub rwmixread: u8,
    /// Bound of every wait (connection, each vhost-user reply, each completion).
    pub timeout: Duration,
    /// Queue size; `None`: the smallest power of two that holds `iodepth` requests.
    pub queue_size: Option<u16>,
    /// Negotiate ACCESS_PLATFORM, refuse EVENT_IDX / INDIRECT_DESC.
    pub wanted: Wanted,
    /// Seed of offsets and of the verify pattern.
    pub seed: u64,
}

impl LoadConfig {
    /// fio's defaults: randread, 4 KiB, depth 1, one job, one pass over the device.
    pub fn new(socket: PathBuf) -> Self {
        Self {
            socket,
            rw: Rw::RandRead,
            bs: 4096,
            iodepth: 1,
            numjobs: 1,
            runtime: None,
            size: None,
            verify: false,
            rwmixread: 50,
            timeout: Duration::from_secs(10),
            queue_size: None,
            wanted: Wanted::default(),
            seed: 0x6c6f_6164_6765_6e00,
        }
    }

    /// Checks what can be checked before connecting.
    ///
    /// # Errors
    /// [`Error::Config`] naming the option.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.bs < 512 || self.bs % 512 != 0 {
            return bad(format!(
                "--bs {} is not a positive multiple of 512",
                self.bs
            ));
        }
        if self.iodepth == 0 || self.iodepth > MAX_IODEPTH {
            return bad(format!(
                "--iodepth {} is not in 1..={MAX_IODEPTH}",
                self.iodepth
            ));
        }
        if self.numjobs == 0 || self.numjobs > MAX_JOBS {
            return bad(format!(
                "--numjobs {} is not in 1..={MAX_JOBS}",
                self.numjobs
            ));
        }
        if self.runtime.is_some_and(|r| r.is_zero()) {
            return bad("--runtime must be more than 0".into());
        }
        if self.timeout.is_zero() {
            return bad("--timeout must be more than 0".into());
        }
        if self.rwmixread > 100 {
            return bad(format!("--rwmixread {} is more than 100", self.rwmixread));
        }
        if let Some(q) = self.queue_size {
            if !q.is_power_of_two() || q < 2 {
                return bad(format!(
                    "--queue-size {q} is not a power of two of at least 2"
                ));
            }
        }
        if self.size == Some(0) {
            return bad("--size must be more than 0".into());
        }
        Ok(())
    }
}

/// The run as a whole, as printed and in `--json`.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Access pattern.
    pub rw: Rw,
    /// Block size.
    pub bs: u32,
    /// Depth per job.
    pub iodepth: u16,
    /// Jobs.
    pub numjobs: u16,
    /// Queue size used.
    pub queue_size: u16,
    /// Requests used indirect descriptor tables.
    pub indirect: bool,
    /// EVENT_IDX was negotiated.
    pub event_idx: bool,
    /// Data segments per request.
    pub segments: u32,
    /// The device.
    pub device: DeviceInfo,
    /// Per job.
    pub jobs: Vec<JobReport>,
    /// All jobs together (over the longest job's time).
    pub total: TotalReport,
}

/// One job's figures.
#[derive(Clone, Debug, Serialize)]
pub struct JobReport {
    /// Job number (also its queue index).
    pub job: u16,
    /// Time of the measured phase, in seconds.
    pub elapsed: f64,
    /// Reads, if any.
    pub read: Option<DirReport>,
    /// Writes, if any.
    pub write: Option<DirReport>,
    /// What verification did, if on.
    pub verify: Option<job::VerifyReport>,
}

/// All jobs together.
#[derive(Clone, Debug, Serialize)]
pub struct TotalReport {
    /// Time of the longest job, in seconds.
    pub elapsed: f64,
    /// Reads, if any.
    pub read: Option<DirReport>,
    /// Writes, if any.
    pub write: Option<DirReport>,
}

fn dir(stats: &DirStats, elapsed: Duration) -> Option<DirReport> {
    (stats.ios > 0).then(|| stats.report(elapsed))
}

/// How the run uses the device and memory, once the device is known.
#[derive(Clone, Copy, Debug)]
struct Plan {
    queue_size: u16,
    indirect: bool,
    segments: u32,
    size: u64,
    area_bytes: u64,
}

fn plan(cfg: &LoadConfig, info: &DeviceInfo) -> Result<Plan> {
    let bad = |m: String| Err(Error::Config(m));
    if cfg.bs % info.blk_size != 0 {
        return bad(format!(
            "--bs {} is not a multiple of the device's block size {}",
            cfg.bs, info.blk_size
        ));
    }
    if cfg.numjobs > info.queues {
        return bad(format!(
            "--numjobs {} needs {} queues and the device serves {}",
            cfg.numjobs, cfg.numjobs, info.queues
        ));
    }
    let size = cfg.size.unwrap_or(info.capacity);
    if size > info.capacity {
        return bad(format!(
            "--size {size} is larger than the device ({} bytes)",
            info.capacity
        ));
    }
    let per_job = if cfg.verify {
        size / u64::from(cfg.numjobs)
    } else {
        size
    };
    if per_job < u64::from(cfg.bs) {
        return bad(format!(
            "--size {size} leaves less than one block of {} bytes per job",
            cfg.bs
        ));
    }
    if cfg.verify && per_job / u64::from(cfg.bs) > MAX_VERIFY_BLOCKS {
        return bad(format!(
            "--verify keeps one generation per block: at most {MAX_VERIFY_BLOCKS} blocks per job (use a smaller --size or a larger --bs)"
        ));
    }
    let segments = match info.size_max {
        Some(m) => cfg.bs.div_ceil(m),
        None => 1,
    };
    if let Some(s) = info.seg_max {
        if segments > s {
            return bad(format!(
                "--bs {} needs {segments} segments of at most {} bytes and the device takes {s}",
                cfg.bs,
                info.size_max.unwrap_or(0)
            ));
        }
    }
    let indirect = info.has(feature(VIRTIO_RING_F_INDIRECT_DESC));
    let descs_per_req = u64::from(segments) + 2;
    let need = if indirect {
        u64::from(cfg.iodepth)
    } else {
        u64::from(cfg.iodepth) * descs_per_req
    };
    let queue_size = match cfg.queue_size {
        Some(q) if u64::from(q) < need => {
            return bad(format!(
                "--queue-size {q} cannot hold {} requests of {descs_per_req} descriptors{}",
                cfg.iodepth,
                if indirect { " (indirect)" } else { "" }
            ))
        }
        Some(q) => q,
        None => match u16::try_from(need.next_power_of_two().max(2)) {
            Ok(q) if q <= 32768 => q,
            _ => {
                return bad(format!(
                    "{} requests of {descs_per_req} descriptors need a queue larger than 32768",
                    cfg.iodepth
                ))
            }
        },
    };
    let area_bytes = JobArea::bytes(queue_size, cfg.iodepth, cfg.bs, segments);
    let total = area_bytes
        .checked_mul(u64::from(cfg.numjobs))
        .filter(|&t| t <= MAX_MEMORY);
    if total.is_none() {
        return bad(format!(
            "--bs {} x --iodepth {} x --numjobs {} needs more than {} GiB of shared memory",
            cfg.bs,
            cfg.iodepth,
            cfg.numjobs,
            MAX_MEMORY >> 30
        ));
    }
    Ok(Plan {
        queue_size,
        indirect,
        segments,
        size,
        area_bytes,
    })
}

/// Connects, runs every job and reports.
///
/// # Errors
/// The first error of any job, or of the set-up.
pub fn run(cfg: &LoadConfig) -> Result<Report> {
    cfg.validate()?;
    let wanted = Wanted {
        writes: cfg.rw.writes() || cfg.verify,
        ..cfg.wanted
    };
    let mut session = Session::connect(&cfg.socket, cfg.timeout, wanted)?;
    let info = *session.info();
    let plan = plan(cfg, &info)?;
    let mem = session::guest_memory(plan.area_bytes * u64::from(cfg.numjobs))?;
    let os = |what| move |source| Error::Os { what, source };
    let mut setups = Vec::new();
    let mut areas = Vec::new();
    for j in 0..cfg.numjobs {
        let area = JobArea::at(
            u64::from(j) * plan.area_bytes,
            plan.queue_size,
            cfg.iodepth,
            cfg.bs,
            plan.segments,
        );
        setups.push(QueueSetup {
            layout: ring_layout(area.base, plan.queue_size),
            kick: EventFd::new(libc::EFD_NONBLOCK).map_err(os("creating a kick eventfd"))?,
            call: EventFd::new(libc::EFD_NONBLOCK).map_err(os("creating a call eventfd"))?,
        });
        areas.push(area);
    }
    // Rings are zeroed before the back end learns where they are.
    let mut jobs = Vec::new();
    let stop = Arc::new(AtomicBool::new(false));
    for (j, (area, setup)) in areas.iter().zip(&setups).enumerate() {
        let j = u16::try_from(j).unwrap_or(u16::MAX);
        let (start, len) = if cfg.verify {
            let per = plan.size / u64::from(cfg.numjobs) / u64::from(cfg.bs) * u64::from(cfg.bs);
            (u64::from(j) * per, per)
        } else {
            (0, plan.size / u64::from(cfg.bs) * u64::from(cfg.bs))
        };
        jobs.push(Job::new(
            cfg,
            j,
            &info,
            mem.clone(),
            *area,
            plan.indirect,
            start,
            len,
            setup,
            session.watch_fd(),
            stop.clone(),
        )?);
    }
    session.start(&mem, &setups)?;

    let done = run_jobs(jobs)?;
    session.stop()?;

    Ok(report(cfg, &plan, info, &done))
}

/// Runs each job on its own thread; the outcomes of the jobs that ran to the end, or the
/// first error (a job stopped because another failed is not an error of its own).
fn run_jobs(jobs: Vec<Job>) -> Result<Vec<JobOutcome>> {
    let outcomes: Vec<Result<JobOutcome>> = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .into_iter()
            .map(|job| {
                std::thread::Builder::new()
                    .name(format!("load-job{}", job.id()))
                    .spawn_scoped(s, move || job.run())
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|_| Err(Error::Misbehaved("a job thread panicked".into()))),
                Err(e) => Err(Error::Os {
                    what: "starting a job thread",
                    source: e,
                }),
            })
            .collect()
    });
    let mut done = Vec::new();
    let mut first_err = None;
    for o in outcomes {
        match o {
            Ok(o) => done.push(o),
            Err(Error::Stopped) => {}
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    Ok(done)
}

/// The report of a finished run.
fn report(cfg: &LoadConfig, plan: &Plan, info: DeviceInfo, done: &[JobOutcome]) -> Report {
    let mut read = DirStats::default();
    let mut write = DirStats::default();
    let mut longest = Duration::ZERO;
    let mut job_reports = Vec::new();
    for o in done {
        read.merge(&o.read);
        write.merge(&o.write);
        longest = longest.max(o.elapsed);
        job_reports.push(JobReport {
            job: o.job,
            elapsed: o.elapsed.as_secs_f64(),
            read: dir(&o.read, o.elapsed),
            write: dir(&o.write, o.elapsed),
            verify: o.verify,
        });
    }
    Report {
        rw: cfg.rw,
        bs: cfg.bs,
        iodepth: cfg.iodepth,
        numjobs: cfg.numjobs,
        queue_size: plan.queue_size,
        indirect: plan.indirect,
        event_idx: info.has(feature(VIRTIO_RING_F_EVENT_IDX)),
        segments: plan.segments,
        device: info,
        jobs: job_reports,
        total: TotalReport {
            elapsed: longest.as_secs_f64(),
            read: dir(&read, longest),
            write: dir(&write, longest),
        },
    }
}

/// Parses a byte count the way fio does: a number with an optional `k`, `m`, `g` or `t`
/// suffix (powers of 1024, an optional trailing `b`/`ib`); a bare number is bytes.
pub fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let t = t
        .strip_suffix("ib")
        .or_else(|| t.strip_suffix('b'))
        .unwrap_or(&t);
    let (num, shift) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 10),
        Some('m') => (&t[..t.len() - 1], 20),
        Some('g') => (&t[..t.len() - 1], 30),
        Some('t') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1u64 << shift))
        .ok_or_else(|| format!("'{s}' is not a size (e.g. 4096, 4k, 1m, 2g)"))
}

/// Formats a report the way fio's normal output reads.
pub fn format_report(r: &Report) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "bouncevm-load: rw={} bs={} iodepth={} numjobs={} queue_size={} indirect={} event_idx={} (device: {} bytes, blk_size {})",
        r.rw.name(),
        r.bs,
        r.iodepth,
        r.numjobs,
        r.queue_size,
        r.indirect,
        r.event_idx,
        r.device.capacity,
        r.device.blk_size
    );
    let line = |out: &mut String, name: &str, d: &DirReport, elapsed: f64| {
        let _ = writeln!(
            out,
            "  {name}: IOPS={}, BW={:.1}MiB/s ({:.1}MB/s)({:.1}MiB/{:.0}msec)",
            human(d.iops),
            d.bw_bytes / 1048576.0,
            d.bw_bytes / 1e6,
            d.bytes as f64 / 1048576.0,
            elapsed * 1000.0
        );
        let l = &d.lat_ns;
        let _ = writeln!(
            out,
            "    clat (usec): min={:.1}, max={:.1}, mean={:.1}, p50={:.1}, p99={:.1}, p99.9={:.1}",
            l.min as f64 / 1000.0,
            l.max as f64 / 1000.0,
            l.mean / 1000.0,
            l.p50 as f64 / 1000.0,
            l.p99 as f64 / 1000.0,
            l.p99_9 as f64 / 1000.0
        );
    };
    for j in &r.jobs {
        let _ = writeln!(out, "job{} (queue {}):", j.job, j.job);
        if let Some(d) = &j.read {
            line(&mut out, "read", d, j.elapsed);
        }
        if let Some(d) = &j.write {
            line(&mut out, "write", d, j.elapsed);
        }
        if let Some(v) = &j.verify {
            let _ = writeln!(
                out,
                "  verify: {} blocks prefilled, {} reads verified during the run, {} blocks read back and verified at the end ({} never written), 0 mismatches",
                v.prefilled, v.verified_reads, v.checked, v.unwritten
            );
        }
    }
    let _ = writeln!(out, "All jobs:");
    if let Some(d) = &r.total.read {
        line(&mut out, "read", d, r.total.elapsed);
    }
    if let Some(d) = &r.total.write {
        line(&mut out, "write", d, r.total.elapsed);
    }
    out
}

/// 12345 -> "12.3k", as fio prints IOPS.
fn human(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if v >= 1e4 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_fio() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("4k"), Ok(4096));
        assert_eq!(parse_bytes("4KiB"), Ok(4096));
        assert_eq!(parse_bytes("1M"), Ok(1 << 20));
        assert_eq!(parse_bytes("2g"), Ok(2 << 30));
        assert!(parse_bytes("four").is_err());
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("99999999999t").is_err());
    }

    #[test]
    fn options_are_checked_before_connecting() {
        let ok = LoadConfig::new("/nonexistent".into());
        assert!(ok.validate().is_ok());
        for (cfg, word) in [
            (
                LoadConfig {
                    bs: 1000,
                    ..ok.clone()
                },
                "--bs",
            ),
            (
                LoadConfig {
                    iodepth: 0,
                    ..ok.clone()
                },
                "--iodepth",
            ),
            (
                LoadConfig {
                    iodepth: 2000,
                    ..ok.clone()
                },
                "--iodepth",
            ),
            (
                LoadConfig {
                    numjobs: 0,
                    ..ok.clone()
                },
                "--numjobs",
            ),
            (
                LoadConfig {
                    rwmixread: 101,
                    ..ok.clone()
                },
                "--rwmixread",
            ),
            (
                LoadConfig {
                    queue_size: Some(100),
                    ..ok.clone()
                },
                "--queue-size",
            ),
            (
                LoadConfig {
                    size: Some(0),
                    ..ok.clone()
                },
                "--size",
            ),
            (
                LoadConfig {
                    runtime: Some(Duration::ZERO),
                    ..ok.clone()
                },
                "--runtime",
            ),
        ] {
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(word), "{e}");
        }
    }

    fn info() -> DeviceInfo {
        DeviceInfo {
            offered: 0,
            acked: feature(VIRTIO_RING_F_INDIRECT_DESC),
            protocol: 0,
            capacity: 1 << 30,
            blk_size: 512,
            size_max: Some(65536),
            seg_max: Some(126),
            queues: 2,
        }
    }

    #[test]
    fn the_plan_fits_the_device() {
        let cfg = LoadConfig {
            iodepth: 32,
            ..LoadConfig::new("/x".into())
        };
        let p = plan(&cfg, &info()).unwrap();
        assert_eq!((p.queue_size, p.indirect, p.segments), (32, true, 1));
        // Without indirect descriptors each request takes 3 descriptors.
        let direct = DeviceInfo { acked: 0, ..info() };
        assert_eq!(plan(&cfg, &direct).unwrap().queue_size, 128);
        // 1 MiB blocks split into 64 KiB segments.
        let big = LoadConfig {
            bs: 1 << 20,
            ..cfg.clone()
        };
        assert_eq!(plan(&big, &info()).unwrap().segments, 16);
        for (c, i, word) in [
            (
                LoadConfig {
                    numjobs: 3,
                    ..cfg.clone()
                },
                info(),
                "queues",
            ),
            (
                LoadConfig {
                    size: Some(2 << 30),
                    ..cfg.clone()
                },
                info(),
                "larger",
            ),
            (
                LoadConfig {
                    queue_size: Some(16),
                    ..cfg.clone()
                },
                info(),
                "cannot hold",
            ),
            (
                LoadConfig {
                    bs: 512,
                    ..cfg.clone()
                },
                DeviceInfo {
                    blk_size: 4096,
                    ..info()
                },
                "block size",
            ),
            (
                big.clone(),
                DeviceInfo {
                    seg_max: Some(8),
                    ..info()
                },
                "segments",
            ),
        ] {
            let e = plan(&c, &i).unwrap_err().to_string();
            assert!(e.contains(word), "{e}");
        }
    }
}
