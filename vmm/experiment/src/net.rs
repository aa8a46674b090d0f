//! Host-level net samples: DPDK's `virtio_user` (a real vhost-user-net front end, run by
//! `dpdk-testpmd` in txonly mode) against `bouncevm-vhost net`, whose tap lives in a network
//! namespace created for the sample and deleted after it (the approach of
//! `tests/e2e/bench_net_dpdk.py`). Frames/s is the tap's `rx_packets` delta over the measured
//! window: what really reached the kernel. Needs root, `/dev/net/tun` and `dpdk-testpmd`.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::host::{self, BackendPaths, Child, NetNs, Waited, WorkDir};
use crate::{backend_pool, Error, Result, Sample};

/// What to install when testpmd is missing.
pub const DPDK_INSTALL: &str =
    "apt-get install --no-install-recommends dpdk-dev librte-net-virtio23";

/// Drives `bouncevm-vhost net` samples with testpmd.
#[derive(Debug)]
pub struct NetDriver {
    vhost: PathBuf,
    testpmd: PathBuf,
    work: WorkDir,
    warmup: Duration,
    count: u32,
}

impl NetDriver {
    /// Checks root, the tun device, testpmd and the backend binary.
    ///
    /// # Errors
    /// [`Error::Missing`] naming what to install or how to run.
    pub fn new(vhost: &Path, quick: bool) -> Result<Self> {
        if !host::is_root() {
            return Err(Error::Missing(
                "the net presets need root (network namespace, tap, DPDK): run as root".into(),
            ));
        }
        if !Path::new("/dev/net/tun").exists() {
            return Err(Error::Missing(
                "the net presets need /dev/net/tun (modprobe tun)".into(),
            ));
        }
        let testpmd = host::which("dpdk-testpmd").ok_or_else(|| {
            Error::Missing(format!(
                "dpdk-testpmd is missing (DPDK's virtio_user drives the net presets): {DPDK_INSTALL}"
            ))
        })?;
        host::require_binary(vhost)?;
        Ok(Self {
            vhost: vhost.to_path_buf(),
            testpmd,
            work: WorkDir::new(&std::env::temp_dir(), "net")?,
            warmup: Duration::from_millis(if quick { 300 } else { 1000 }),
            count: 0,
        })
    }

    /// One sample of a [`crate::Workload::Net`] (its `bounce`, `queues` and `frame`) for `dur` after a
    /// warm-up.
    ///
    /// # Errors
    /// The backend's or testpmd's failure.
    pub fn measure(
        &mut self,
        bounce: &str,
        queues: u16,
        frame: u32,
        dur: Duration,
    ) -> Result<Sample> {
        self.count += 1;
        let tag = format!("bvmx{}n{}", std::process::id(), self.count);
        let ns = NetNs::new(&tag)?;
        let paths = BackendPaths::new(&self.work, "net");
        let q = queues.to_string();
        let argv = paths.argv(
            &self.vhost,
            "net",
            bounce,
            &["--tap", "tap0", "--queues", &q],
        );
        let mut backend = paths.spawn("bouncevm-vhost net", &ns.exec(&argv))?;
        host::run_cmd("ip", &["-n", ns.name(), "link", "set", "tap0", "up"])?;
        let tp = self.testpmd_argv(&tag, &paths.sock, frame, &q);
        let tp_log = self.work.path("testpmd.log");
        let mut testpmd = Child::spawn("dpdk-testpmd", &tp, &tp_log, None, Duration::ZERO)?;
        wait_for_frames(&ns, &mut testpmd)?;
        if !bounce_tools::report::sleep_unless_stopped(self.warmup) {
            return Err(Error::Run("interrupted".into()));
        }
        host::stats(&paths.stats, true)?;
        let cpu0 = backend.cpu_ns();
        let (before, t0) = (ns.counter("tap0", "rx_packets")?, Instant::now());
        bounce_tools::report::sleep_unless_stopped(dur);
        let (after, t1) = (ns.counter("tap0", "rx_packets")?, Instant::now());
        let cpu1 = backend.cpu_ns();
        let st = host::stats(&paths.stats, false)?;
        testpmd.interrupt();
        if !testpmd.wait_exit(Duration::from_secs(10)) {
            testpmd.stop();
        }
        backend.stop();
        drop(ns);
        let frames = after.saturating_sub(before) as f64;
        let secs = (t1 - t0).as_secs_f64();
        if frames <= 0.0 {
            return Err(Error::Run(format!(
                "no frame reached the tap in {secs:.1} s (testpmd: {})",
                std::fs::read_to_string(&tp_log)
                    .unwrap_or_default()
                    .lines()
                    .rev()
                    .take(3)
                    .collect::<Vec<_>>()
                    .join(" | ")
            )));
        }
        Ok(sample(frames, secs, frame, (cpu0, cpu1), &st))
    }

    /// testpmd's command line: `virtio_user` on the backend's socket `sock` with `q` queue
    /// pairs, sending `frame`-byte frames (txonly) from one core; `tag` keeps its EAL files apart.
    fn testpmd_argv(&self, tag: &str, sock: &Path, frame: u32, q: &str) -> Vec<OsString> {
        [
            self.testpmd.to_string_lossy().as_ref(),
            "-l",
            "0,1",
            "--no-huge",
            "-m",
            "1024",
            "--no-pci",
            "--file-prefix",
            tag,
            &format!("--vdev=net_virtio_user0,path={},queues={q}", sock.display()),
            "--",
            "--forward-mode=txonly",
            &format!("--txpkts={frame}"),
            &format!("--txq={q}"),
            &format!("--rxq={q}"),
            "--stats-period",
            "1",
            "--auto-start",
            "--nb-cores=1",
            "--total-num-mbufs=16384",
        ]
        .iter()
        .map(OsString::from)
        .collect()
    }
}

/// Waits until frames from `testpmd` reach the tap in `ns` (at most 30 s).
///
/// testpmd's EAL start-up (1 GiB of --no-huge memory) takes seconds on a loaded machine: wait
/// until frames flow, then warm up.
fn wait_for_frames(ns: &NetNs, testpmd: &mut Child) -> Result<()> {
    let flowing = || {
        if ns.counter("tap0", "rx_packets")? > 0 {
            return Ok(true);
        }
        if bounce_tools::report::stopped() {
            return Err(Error::Run("interrupted".into()));
        }
        Ok(false)
    };
    let why =
        match testpmd.wait_until(Duration::from_secs(30), Duration::from_millis(100), flowing)? {
            Waited::Ready => return Ok(()),
            Waited::Exited(_) => "dpdk-testpmd exited before sending",
            Waited::Late => "no frame reached the tap in 30 s",
        };
    Err(Error::Run(format!("{why}: {}", testpmd.log_tail())))
}

/// The sample's metrics from `frames` of `frame` bytes in `secs`, the backend's CPU time
/// before and after (`cpu`) and its stats `st` (pool and device).
fn sample(
    frames: f64,
    secs: f64,
    frame: u32,
    cpu: (Option<u64>, Option<u64>),
    st: &serde_json::Value,
) -> Sample {
    let (cpu0, cpu1) = cpu;
    let fps = frames / secs;
    let mut m = BTreeMap::new();
    m.insert("kfps".into(), fps / 1e3);
    m.insert("gbps".into(), fps * f64::from(frame) * 8.0 / 1e9);
    if let (Some(a), Some(b)) = (cpu0, cpu1) {
        m.insert(
            "cpu_ns_per_frame".into(),
            b.saturating_sub(a) as f64 / frames,
        );
    }
    let detail = serde_json::json!({
        "frames": frames,
        "seconds": secs,
        "device": st.get("device"),
    });
    let mut s = Sample::with_pool(m, backend_pool(st), frames, Some(detail));
    let wait = s
        .pool
        .as_ref()
        .and_then(|p| p.get("lock_wait_ns")?.as_f64());
    if let (Some(w), Some(a), Some(b)) = (wait, cpu0, cpu1) {
        let cpu = b.saturating_sub(a) as f64;
        if cpu > 0.0 {
            s.metrics.insert("lock_wait_pct".into(), 100.0 * w / cpu);
        }
    }
    s
}
