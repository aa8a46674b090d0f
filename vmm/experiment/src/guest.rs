//! Guest-level samples through `tests/e2e/experiment_guest.py` (the rig-1 harness boots the
//! guest, runs the workload and reads the backend's statistics socket). One guest at a time;
//! each sample boots its own guest (QEMU TCG: the guest is the bottleneck, so these confirm
//! the path end to end, they do not rank allocators).
//! - Block: fio random reads on a disk served by `bouncevm-vhost blk` with the cell's bounce
//!   setting. The guest image's fio job is a random read, so sequential patterns run as random
//!   reads here (the table says so).
//! - Net ([`Workload::Iperf3`]): iperf3 from the guest to a server in a network namespace
//!   created for the sample, through `bouncevm-vhost net` on a tap in that namespace; the
//!   image's iperf3 test then runs host -> guest too, so the pool's statistics cover both.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::host::{self, Child, WorkDir};
use crate::{backend_pool, Error, Result, Sample, Workload};

/// Drives rig-1 guest samples.
#[derive(Debug)]
pub struct GuestDriver {
    python: PathBuf,
    script: PathBuf,
    vhost: PathBuf,
    work: WorkDir,
}

impl GuestDriver {
    /// Checks python3, the driver script and the backend binary (the script checks QEMU, the
    /// guest images and root itself).
    ///
    /// # Errors
    /// [`Error::Missing`] naming what is missing.
    pub fn new(repo: &Path, vhost: &Path, _quick: bool) -> Result<Self> {
        let python = host::which("python3").ok_or_else(|| {
            Error::Missing("--level guest needs python3 (apt-get install python3)".into())
        })?;
        let script = repo.join("tests/e2e/experiment_guest.py");
        if !script.is_file() {
            return Err(Error::Missing(format!(
                "--level guest needs {} (run from the repository, or set BVM_REPO)",
                script.display()
            )));
        }
        host::require_binary(vhost)?;
        Ok(Self {
            python,
            script,
            vhost: vhost.to_path_buf(),
            work: WorkDir::new(&std::env::temp_dir(), "guest")?,
        })
    }

    /// One guest boot running `w` (fio or iperf3) for `dur` (at least 2 s).
    ///
    /// # Errors
    /// [`Error::Missing`] when the rig cannot run here, [`Error::Run`] when the guest fails.
    pub fn measure(&mut self, w: &Workload, dur: Duration) -> Result<Sample> {
        let runtime = dur.as_secs().max(2);
        let v = self.run_script(mode_args(w)?, runtime)?;
        figures(w, v)
    }

    /// Runs the rig-1 script with `mode_args` for `runtime` seconds and returns the figures it
    /// wrote (or why it could not run: [`Error::Missing`] when it printed `MISSING:`).
    fn run_script(&self, mode_args: Vec<String>, runtime: u64) -> Result<serde_json::Value> {
        let out = self.work.path("guest.json");
        let _ = std::fs::remove_file(&out);
        let mut argv: Vec<OsString> = vec![
            self.python.clone().into(),
            self.script.clone().into(),
            "--vhost".into(),
            self.vhost.clone().into(),
        ];
        argv.extend(mode_args.into_iter().map(OsString::from));
        argv.extend([
            "--runtime".into(),
            runtime.to_string().into(),
            "--out".into(),
            out.clone().into(),
        ]);
        let log = self.work.path("guest.log");
        let mut p = Child::spawn("experiment_guest.py", &argv, &log, None, Duration::ZERO)?;
        // iperf3 runs both ways, one after the other.
        let limit = Duration::from_secs(120 + 4 * runtime);
        if !p.wait_exit(limit) {
            p.stop();
            return Err(Error::Run(format!(
                "the rig-1 guest did not finish in {limit:?}: {}",
                p.log_tail()
            )));
        }
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        match serde_json::from_str(&text) {
            Ok(v) => Ok(v),
            Err(_) => {
                let tail = p.log_tail();
                let log_text = std::fs::read_to_string(&log).unwrap_or_default();
                Err(if log_text.contains("MISSING:") {
                    Error::Missing(format!("--level guest cannot run here: {tail}"))
                } else {
                    Error::Run(format!("the rig-1 guest gave no figures: {tail}"))
                })
            }
        }
    }
}

/// The script's arguments for `w`: its mode (blk or net) and the workload's parameters.
fn mode_args(w: &Workload) -> Result<Vec<String>> {
    Ok(match w {
        Workload::Block {
            bounce,
            bs,
            iodepth,
            numjobs,
            queues,
            ..
        } => vec![
            "--mode".into(),
            "blk".into(),
            "--bounce".into(),
            bounce.clone(),
            "--bs".into(),
            bs.to_string(),
            "--iodepth".into(),
            iodepth.to_string(),
            "--numjobs".into(),
            numjobs.to_string(),
            "--queues".into(),
            queues.to_string(),
        ],
        Workload::Iperf3 {
            bounce,
            queues,
            parallel,
        } => vec![
            "--mode".into(),
            "net".into(),
            "--bounce".into(),
            bounce.clone(),
            "--queues".into(),
            queues.to_string(),
            "--parallel".into(),
            parallel.to_string(),
        ],
        _ => return Err(Error::Run("not a guest-level workload".into())),
    })
}

/// The sample from the figures `v` the script wrote for `w`: IOPS and MB/s (block) or Gbit/s
/// (net), and the pool's metrics per I/O.
fn figures(w: &Workload, v: serde_json::Value) -> Result<Sample> {
    let f = |k: &str| v.get(k).and_then(serde_json::Value::as_f64);
    let mut m = BTreeMap::new();
    // The I/Os the pool's lock wait is divided by: requests, or frames both ways.
    let ios = match w {
        Workload::Block { bs, .. } => {
            let iops = f("iops").unwrap_or(0.0);
            if iops <= 0.0 {
                return Err(Error::Run(format!("the rig-1 guest reported no IOPS: {v}")));
            }
            m.insert("iops".into(), iops);
            m.insert("mbps".into(), iops * f64::from(*bs) / 1e6);
            f("ios").unwrap_or(0.0)
        }
        _ => {
            let gbps = f("gbps").unwrap_or(0.0);
            if gbps <= 0.0 {
                return Err(Error::Run(format!(
                    "the rig-1 guest reported no iperf3 throughput: {v}"
                )));
            }
            m.insert("gbps".into(), gbps);
            if let Some(rx) = f("rx_gbps") {
                m.insert("rx_gbps".into(), rx);
            }
            ["tx_frames", "rx_frames"]
                .iter()
                .filter_map(|k| v.pointer(&format!("/device/net/{k}"))?.as_f64())
                .sum()
        }
    };
    let pool = backend_pool(&v);
    Ok(Sample::with_pool(m, pool, ios, Some(v)))
}
