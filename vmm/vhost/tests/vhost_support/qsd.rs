//! qemu-storage-daemon as a peer back end: exporting a raw image over vhost-user-blk, and
//! exporting a throttled raw image as a file (FUSE) that holds every request a back end makes
//! on it (a slow disk both back ends can be given).
#![allow(dead_code)]

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A qemu-storage-daemon process and the directory of its files, both gone when dropped.
pub struct Qsd {
    child: Child,
    /// Its vhost-user socket, or its FUSE-exported file.
    pub path: PathBuf,
    dir: PathBuf,
}

impl Drop for Qsd {
    fn drop(&mut self) {
        // SIGTERM: a FUSE export unmounts its file on the way out (SIGKILL would leave a dead
        // mount behind).
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// True when qemu-storage-daemon runs; otherwise records it as a missing resource.
fn installed() -> bool {
    let runs = Command::new("qemu-storage-daemon")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !runs {
        bounce::testing::missing(
            bounce::testing::Resource::QemuStorageDaemon,
            "qemu-storage-daemon is not installed",
        );
    }
    runs
}

/// A fresh directory for one daemon (tests of one file run in parallel).
fn fresh_dir() -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("bouncevm-qsd-{}.{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A 16 MiB raw image in `dir`.
fn image_in(dir: &Path) -> PathBuf {
    let img = dir.join("disk.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    img
}

fn spawn(args: &[String]) -> Child {
    Command::new("qemu-storage-daemon")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

/// qemu-storage-daemon exporting a 16 MiB raw image over vhost-user-blk with `queues`
/// queues, or `None` (recorded as a missing resource).
pub fn qsd(queues: usize) -> Option<Qsd> {
    let dir = fresh_dir();
    let img = image_in(&dir);
    export(&img.display().to_string(), queues, dir)
}

/// qemu-storage-daemon exporting the raw image `img` with O_DIRECT (`cache.direct=on`) over
/// vhost-user-blk with `queues` queues, or `None` (recorded as a missing resource).
pub fn qsd_on(img: &Path, queues: usize) -> Option<Qsd> {
    export(
        &format!("{},cache.direct=on", img.display()),
        queues,
        fresh_dir(),
    )
}

/// qemu-storage-daemon exporting `img` (its file name and any further file options), its
/// socket in `dir` (removed when it is dropped).
fn export(img: &str, queues: usize, dir: PathBuf) -> Option<Qsd> {
    if !installed() {
        return None;
    }
    let sock = dir.join("qsd.sock");
    let child = spawn(&[
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={img}"),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=e0,node-name=f0,addr.type=unix,addr.path={},writable=on,\
             num-queues={queues}",
            sock.display()
        ),
    ]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sock.exists() {
        assert!(
            Instant::now() < deadline,
            "qemu-storage-daemon never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(Qsd {
        child,
        path: sock,
        dir,
    })
}

/// A 16 MiB raw image behind a throttle of `iops` requests per second, exported by
/// qemu-storage-daemon as the file [`Qsd::path`] (FUSE): a disk that holds every request a
/// back end makes on it. `None` (recorded as a missing resource) without qemu-storage-daemon
/// or FUSE.
pub fn slow_image(iops: u32) -> Option<Qsd> {
    if !installed() {
        return None;
    }
    let dir = fresh_dir();
    let img = image_in(&dir);
    let file = dir.join("slow.img");
    std::fs::File::create(&file).unwrap();
    let before = std::fs::metadata(&file).unwrap().dev();
    let child = spawn(&[
        "--object".into(),
        format!("throttle-group,id=tg,x-iops-total={iops}"),
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", img.display()),
        "--blockdev".into(),
        "driver=throttle,node-name=t0,file=f0,throttle-group=tg".into(),
        "--export".into(),
        format!(
            "type=fuse,id=e0,node-name=t0,mountpoint={},writable=on",
            file.display()
        ),
    ]);
    let mut qsd = Qsd {
        child,
        path: file,
        dir,
    };
    // Mounted once the file is on another device.
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::metadata(&qsd.path).unwrap().dev() == before {
        if qsd.child.try_wait().unwrap().is_some() || Instant::now() >= deadline {
            bounce::testing::missing(
                bounce::testing::Resource::QemuStorageDaemon,
                "qemu-storage-daemon cannot export a file over FUSE (/dev/fuse)",
            );
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(qsd)
}
