//! `bouncevm-vhost blk` as a child process, for the tests that drive the binary.
#![allow(dead_code)]

use std::fs::File;
use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_bouncevm-vhost");
/// Descriptors a server may hold beyond its count after the first session (statistics
/// clients in flight, a session winding down); a leak of one per session passes it within a
/// few dozen sessions.
pub const FD_SLACK: usize = 16;

/// `bouncevm-vhost blk` in a child process (a crash is seen as one), killed when the test ends.
pub struct Server {
    pub child: Child,
    pub sock: PathBuf,
    pub stats: PathBuf,
    /// Its stderr (a file: a pipe nobody reads would fill and stall it).
    pub log: PathBuf,
    /// What runs the binary (`ip netns exec NS`), if anything.
    prefix: Vec<std::ffi::OsString>,
    /// Its command line after the program name.
    args: Vec<std::ffi::OsString>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// With bounce forced (1024 slots) and a 16 MiB raw image.
    pub fn start() -> Self {
        Self::start_with(&["--bounce", "policy=force,slots=1024"])
    }

    /// With `extra` flags after `--socket`, `--file` and `--stats-socket`.
    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_on(None, extra)
    }

    /// As [`Server::start_with`] on the image `img` (a fresh 16 MiB raw image if `None`).
    pub fn start_on(img: Option<&std::path::Path>, extra: &[&str]) -> Self {
        Self::start_device(
            |dir| {
                let img = img.map_or_else(
                    || {
                        let img = dir.join("disk.img");
                        File::create(&img).unwrap().set_len(16 << 20).unwrap();
                        img
                    },
                    std::path::Path::to_path_buf,
                );
                vec!["blk".into(), "--file".into(), img.into()]
            },
            extra,
        )
    }

    /// `bouncevm-vhost net` (one queue pair) on tap `tap` (created, and gone with the
    /// process), with `extra` flags after `--tap`, `--socket` and `--stats-socket`. Needs
    /// root and `/dev/net/tun`.
    pub fn start_net(tap: &str, extra: &[&str]) -> Self {
        Self::start_device(|_| vec!["net".into(), "--tap".into(), tap.into()], extra)
    }

    /// [`Server::start_net`] with the process in the network namespace `ns` (its tap too):
    /// run through `ip netns exec`, which execs the binary (the child is the server itself).
    pub fn start_net_in(ns: &str, tap: &str, extra: &[&str]) -> Self {
        Self::start_prefixed(
            ["ip", "netns", "exec", ns].map(Into::into).to_vec(),
            |_| vec!["net".into(), "--tap".into(), tap.into()],
            extra,
        )
    }

    /// The binary with the subcommand and flags `device` makes in the server's own new
    /// directory (the tests of a file run in parallel), then `--socket`, `--stats-socket` and
    /// `extra`.
    fn start_device(
        device: impl FnOnce(&std::path::Path) -> Vec<std::ffi::OsString>,
        extra: &[&str],
    ) -> Self {
        Self::start_prefixed(Vec::new(), device, extra)
    }

    /// [`Server::start_device`] run by the command `prefix` (nothing: the binary itself).
    fn start_prefixed(
        prefix: Vec<std::ffi::OsString>,
        device: impl FnOnce(&std::path::Path) -> Vec<std::ffi::OsString>,
        extra: &[&str],
    ) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("bouncevm-vhost-child-{}.{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (sock, stats) = (dir.join("vhost.sock"), dir.join("vhost.stats"));
        let log = dir.join("vhost.log");
        let _ = std::fs::remove_file(&sock);
        let _ = std::fs::remove_file(&stats);
        let mut args = device(&dir);
        args.extend(["--socket".into(), sock.clone().into()]);
        args.extend(["--stats-socket".into(), stats.clone().into()]);
        args.extend(extra.iter().map(Into::into));
        let child = Self::spawn(&prefix, &args, &stats, &log);
        Self {
            child,
            sock,
            stats,
            log,
            prefix,
            args,
        }
    }

    /// Runs the binary with `args` (through `prefix`, if any) and waits for its statistics
    /// socket.
    fn spawn(
        prefix: &[std::ffi::OsString],
        args: &[std::ffi::OsString],
        stats: &std::path::Path,
        log: &std::path::Path,
    ) -> Child {
        let mut command = match prefix.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(BIN);
                c
            }
            None => Command::new(BIN),
        };
        let child = command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::options().create(true).append(true).open(log).unwrap())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !stats.exists() {
            assert!(Instant::now() < deadline, "the server never started");
            std::thread::sleep(Duration::from_millis(20));
        }
        child
    }

    /// Kills the server with SIGKILL (no cleanup of any kind) and starts it again with the
    /// same command line: the same socket, image and flags.
    pub fn kill_and_restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The dead process's sockets stay behind; the new one replaces them, and its stats
        // socket appearing says it is up.
        let _ = std::fs::remove_file(&self.stats);
        self.child = Self::spawn(&self.prefix, &self.args, &self.stats, &self.log);
    }

    /// Panics with the server's stderr if it is gone.
    pub fn assert_alive(&mut self, what: &str) {
        if let Some(st) = self.child.try_wait().unwrap() {
            let err = std::fs::read_to_string(&self.log).unwrap_or_default();
            panic!("{what}: the server died ({st}): {err}");
        }
    }

    /// The server's open file descriptors once no session is connected (`/proc/PID/fd`).
    pub fn idle_fds(&self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.stats()["server"]["connected"] != false {
            assert!(Instant::now() < deadline, "a session never ended");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .expect("the server's /proc/PID/fd")
            .count()
    }

    /// Fails when the server holds more than `FD_SLACK` descriptors beyond `baseline`
    /// (its count after the first session).
    pub fn assert_no_fd_leak(&self, baseline: usize, sessions: u64) {
        let now = self.idle_fds();
        assert!(
            now <= baseline + FD_SLACK,
            "the server holds {now} file descriptors after {sessions} sessions, {baseline} after \
             the first: descriptors leak per session (see /proc/{}/fd)",
            self.child.id()
        );
    }

    /// The statistics JSON.
    pub fn stats(&self) -> serde_json::Value {
        let mut s = UnixStream::connect(&self.stats).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut line = String::new();
        s.read_to_string(&mut line)
            .expect("the stats socket answers within 5 s");
        serde_json::from_str(line.trim()).unwrap()
    }

    /// Waits for the session to end (the server noticed the disconnect).
    pub fn wait_disconnected(&self, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let st = self.stats();
            if st["server"]["connected"] == false {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: the session never ended: {st}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Lines of the server's log containing `needle`.
    pub fn log_lines(&self, needle: &str) -> usize {
        std::fs::read_to_string(&self.log)
            .unwrap()
            .lines()
            .filter(|l| l.contains(needle))
            .count()
    }
}
