//! Host processes of an experiment: a backend or front end started in its own process group
//! (so a Ctrl-C on the terminal reaches only the experiment, which then stops them cleanly),
//! ready once its pid file or socket exists; its CPU time; the backend's statistics socket;
//! network namespaces that are deleted when dropped.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// `/proc/PID/stat` reports CPU time in USER_HZ ticks, which Linux fixes at 100 per second.
const USER_HZ: u64 = 100;

/// True when running as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Sends `sig` to process `pid` (errors ignored: the process may be gone).
fn signal(pid: u32, sig: libc::c_int) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill only sends a signal; `pid` is a child this process started and has not
    // reaped yet (the caller holds its `std::process::Child`).
    let _ = unsafe { libc::kill(pid, sig) };
}

/// The first `name` on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// How [`Child::wait_until`] ended.
#[derive(Debug)]
pub enum Waited {
    /// What it waited for holds.
    Ready,
    /// The process exited first.
    Exited(std::process::ExitStatus),
    /// The timeout passed first.
    Late,
}

/// A started helper process, stopped (SIGTERM, then SIGKILL) when dropped.
#[derive(Debug)]
pub struct Child {
    name: String,
    child: std::process::Child,
    log: PathBuf,
    stopped: bool,
}

impl Child {
    /// Starts `argv` in its own process group with stdout and stderr to `log`, and waits up to
    /// `timeout` for `ready` to exist (if given).
    ///
    /// # Errors
    /// [`Error::Os`] when it cannot start, [`Error::Run`] (with its log) when it exits or
    /// `ready` does not appear in time.
    pub fn spawn(
        name: &str,
        argv: &[OsString],
        log: &Path,
        ready: Option<&Path>,
        timeout: Duration,
    ) -> Result<Self> {
        let (prog, args) = argv
            .split_first()
            .ok_or_else(|| Error::Run(format!("{name}: empty command")))?;
        let os = |what: String| move |source| Error::Os { what, source };
        let out = std::fs::File::create(log).map_err(os(format!("{}", log.display())))?;
        let err = out.try_clone().map_err(os(format!("{}", log.display())))?;
        let child = Command::new(prog)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .env("BOUNCEVM_LOG", "warn")
            .process_group(0)
            .spawn()
            .map_err(os(format!("cannot start {}", prog.to_string_lossy())))?;
        let mut c = Self {
            name: name.into(),
            child,
            log: log.into(),
            stopped: false,
        };
        let Some(ready) = ready else {
            return Ok(c);
        };
        let why = match c.wait_until(timeout, Duration::from_millis(10), || Ok(ready.exists()))? {
            Waited::Ready => return Ok(c),
            Waited::Exited(st) => format!("{name} exited ({st}) before it was ready"),
            Waited::Late => format!(
                "{name} was not ready in {timeout:?} ({} missing)",
                ready.display()
            ),
        };
        Err(Error::Run(format!("{why}: {}", c.log_tail())))
    }

    /// Polls `ready` every `period` until it holds, the process exits or `timeout` passes.
    ///
    /// # Errors
    /// What `ready` returns.
    pub fn wait_until(
        &mut self,
        timeout: Duration,
        period: Duration,
        mut ready: impl FnMut() -> Result<bool>,
    ) -> Result<Waited> {
        let deadline = Instant::now() + timeout;
        while !ready()? {
            if let Ok(Some(st)) = self.child.try_wait() {
                self.stopped = true;
                return Ok(Waited::Exited(st));
            }
            if Instant::now() > deadline {
                return Ok(Waited::Late);
            }
            std::thread::sleep(period);
        }
        Ok(Waited::Ready)
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// True while it runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// User + system CPU time of the whole process (all its threads, live or ended), in ns.
    pub fn cpu_ns(&self) -> Option<u64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).ok()?;
        // Fields after the command name (which may hold spaces) start after the last ')'.
        let rest = stat.rsplit_once(')')?.1;
        let f: Vec<&str> = rest.split_whitespace().collect();
        // utime and stime are fields 14 and 15 of the line; f[0] is field 3.
        let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
        Some(ticks * (1_000_000_000 / USER_HZ))
    }

    /// The last lines of its log, on one line.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().rev().take(4).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }

    /// Sends SIGINT (testpmd prints its statistics and exits on it).
    pub fn interrupt(&self) {
        signal(self.pid(), libc::SIGINT);
    }

    /// Waits up to `timeout` for it to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if !self.running() {
                self.stopped = true;
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// SIGTERM, up to 5 s to exit, then SIGKILL.
    pub fn stop(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        if self.running() {
            signal(self.pid(), libc::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(5);
            while self.running() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if self.running() {
                tracing::warn!("{} did not stop in 5 s: killing it", self.name);
                let _ = self.child.kill();
            }
        }
        let _ = self.child.wait();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One JSON line from a `--stats-socket`; with `reset`, the backend resets its pool's
/// high-water mark, lock counters and time histograms first.
///
/// # Errors
/// [`Error::Run`] when the socket does not answer with JSON within 5 s.
pub fn stats(path: &Path, reset: bool) -> Result<serde_json::Value> {
    let err = |e: String| Error::Run(format!("statistics socket {}: {e}", path.display()));
    let mut s = UnixStream::connect(path).map_err(|e| err(e.to_string()))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| err(e.to_string()))?;
    if reset {
        s.write_all(b"reset\n").map_err(|e| err(e.to_string()))?;
    }
    let mut buf = Vec::new();
    let mut chunk = [0u8; 65536];
    while !buf.ends_with(b"\n") {
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => return Err(err(e.to_string())),
        }
    }
    serde_json::from_slice(&buf).map_err(|e| err(e.to_string()))
}

/// Runs a command to completion, bounded by 30 s.
///
/// # Errors
/// [`Error::Run`] with its stderr when it fails.
pub fn run_cmd(prog: &str, args: &[&str]) -> Result<String> {
    let mut child = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|source| Error::Os {
            what: format!("cannot run {prog}"),
            source,
        })?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                let _ = child.kill();
                break;
            }
        }
    }
    let out = child.wait_with_output().map_err(|source| Error::Os {
        what: prog.to_string(),
        source,
    })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(Error::Run(format!(
            "{prog} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// A network namespace created for one sample, deleted when dropped.
#[derive(Debug)]
pub struct NetNs(String);

impl NetNs {
    /// Creates namespace `name` with its loopback up.
    ///
    /// # Errors
    /// [`Error::Run`] when `ip netns add` fails.
    pub fn new(name: &str) -> Result<Self> {
        let _ = run_cmd("ip", &["netns", "del", name]);
        run_cmd("ip", &["netns", "add", name])?;
        let ns = Self(name.into());
        run_cmd("ip", &["-n", name, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.0
    }

    /// `argv` run inside the namespace.
    pub fn exec(&self, argv: &[OsString]) -> Vec<OsString> {
        ["ip", "netns", "exec", self.0.as_str()]
            .iter()
            .map(OsString::from)
            .chain(argv.iter().cloned())
            .collect()
    }

    /// A counter of `dev` inside the namespace (`/sys/class/net/DEV/statistics/NAME`).
    ///
    /// # Errors
    /// [`Error::Run`] when it cannot be read.
    pub fn counter(&self, dev: &str, name: &str) -> Result<u64> {
        let path = format!("/sys/class/net/{dev}/statistics/{name}");
        let out = run_cmd("ip", &["netns", "exec", &self.0, "cat", &path])?;
        out.trim()
            .parse()
            .map_err(|_| Error::Run(format!("{path} in {}: '{}'", self.0, out.trim())))
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = run_cmd("ip", &["netns", "del", &self.0]);
    }
}

/// [`Error::Missing`] unless `binary` (a bouncevm binary) exists.
///
/// # Errors
/// [`Error::Missing`] saying how to build it.
pub fn require_binary(binary: &Path) -> Result<()> {
    if binary.is_file() {
        Ok(())
    } else {
        Err(Error::Missing(format!(
            "{} is missing: build it with `cargo build --release -p bouncevm-vhost`",
            binary.display()
        )))
    }
}

/// The vhost-user socket, statistics socket, pid file and log of one `bouncevm-vhost` run in a
/// [`WorkDir`], stale copies removed.
#[derive(Debug)]
pub struct BackendPaths {
    /// The vhost-user socket.
    pub sock: PathBuf,
    /// `--stats-socket`.
    pub stats: PathBuf,
    /// `--pidfile`: the backend is ready once it exists.
    pub pidfile: PathBuf,
    /// stdout and stderr.
    pub log: PathBuf,
}

impl BackendPaths {
    /// The paths for device `kind` (`blk`, `net`).
    pub fn new(work: &WorkDir, kind: &str) -> Self {
        let p = Self {
            sock: work.path(&format!("{kind}.sock")),
            stats: work.path(&format!("{kind}.stats")),
            pidfile: work.path(&format!("{kind}.pid")),
            log: work.path(&format!("{kind}.log")),
        };
        for f in [&p.sock, &p.stats, &p.pidfile] {
            let _ = std::fs::remove_file(f);
        }
        p
    }

    /// `VHOST KIND --socket .. --stats-socket .. --pidfile .. --bounce BOUNCE EXTRA..`.
    pub fn argv(&self, vhost: &Path, kind: &str, bounce: &str, extra: &[&str]) -> Vec<OsString> {
        let mut v: Vec<OsString> = vec![vhost.into(), kind.into()];
        for (flag, path) in [
            ("--socket", &self.sock),
            ("--stats-socket", &self.stats),
            ("--pidfile", &self.pidfile),
        ] {
            v.push(flag.into());
            v.push(path.into());
        }
        v.push("--bounce".into());
        v.push(bounce.into());
        v.extend(extra.iter().map(OsString::from));
        v
    }

    /// Starts `argv` and waits (up to 10 s) for its pid file.
    ///
    /// # Errors
    /// See [`Child::spawn`].
    pub fn spawn(&self, name: &str, argv: &[OsString]) -> Result<Child> {
        Child::spawn(
            name,
            argv,
            &self.log,
            Some(&self.pidfile),
            Duration::from_secs(10),
        )
    }
}

/// A scratch directory for one run, removed when dropped.
#[derive(Debug)]
pub struct WorkDir(PathBuf);

impl WorkDir {
    /// Creates `bouncevm-experiment-PID-WHAT` under `base`.
    ///
    /// # Errors
    /// [`Error::Os`] when it cannot be created.
    pub fn new(base: &Path, what: &str) -> Result<Self> {
        let p = base.join(format!("bouncevm-experiment-{}-{what}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).map_err(|source| Error::Os {
            what: format!("cannot create {}", p.display()),
            source,
        })?;
        Ok(Self(p))
    }

    /// `name` inside it.
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str, log: &Path, ready: Option<&Path>, timeout: Duration) -> Result<Child> {
        let argv: Vec<OsString> = ["sh", "-c", script].iter().map(OsString::from).collect();
        Child::spawn("sh", &argv, log, ready, timeout)
    }

    #[test]
    fn spawn_waits_for_ready_and_says_why_it_is_not() {
        let dir = std::env::temp_dir().join(format!("bvmx-host-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (log, ready) = (dir.join("log"), dir.join("ready"));
        let _ = std::fs::remove_file(&ready);
        let touch = format!("sleep 0.2; touch {}; sleep 5", ready.display());
        let mut c = sh(&touch, &log, Some(&ready), Duration::from_secs(10)).unwrap();
        assert!(ready.exists() && c.running());
        c.stop();
        // (script, timeout in ms, what the error says)
        let cases: [(&str, u64, &[&str]); 2] = [
            (
                "echo gone; exit 3",
                10_000,
                &["sh exited (exit status: 3) before it was ready: gone"],
            ),
            (
                "sleep 5",
                100,
                &["sh was not ready in 100ms (", "never missing)"],
            ),
        ];
        for (script, ms, wanted) in cases {
            let never = dir.join("never");
            let e = sh(script, &log, Some(&never), Duration::from_millis(ms))
                .unwrap_err()
                .to_string();
            for w in wanted {
                assert!(e.contains(w), "{script}: {e}");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
