//! An in-process server (any device) with its statistics socket.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::Duration;

use bouncevm_vhost::{Memory, Server};
use devices::virtio::VirtioDevice;

/// A fresh path `name` in this test process's temporary directory.
pub fn socket_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bouncevm-vhost-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    let _ = std::fs::remove_file(&p);
    p
}

/// Starts an in-process server for `device` with a statistics socket; returns the socket, the
/// statistics socket, the join handle (giving the server back) and a stop handle.
pub fn start_server_with_stats<D: VirtioDevice<Memory> + 'static>(
    name: &str,
    device: D,
) -> (
    PathBuf,
    PathBuf,
    thread::JoinHandle<Server<D>>,
    bouncevm_vhost::StopHandle,
) {
    let path = socket_path(name);
    let stats_path = socket_path(&format!("{name}.stats"));
    let mut server = Server::bind("test", device, &path)
        .unwrap()
        .with_stats_socket(&stats_path)
        .unwrap();
    let stop = server.stop_handle().unwrap();
    let t = thread::spawn(move || {
        server.run().unwrap();
        server
    });
    (path, stats_path, t, stop)
}

/// One JSON line from a statistics socket.
pub fn stats(path: &Path) -> serde_json::Value {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut line = String::new();
    s.read_to_string(&mut line).unwrap();
    serde_json::from_str(line.trim()).unwrap()
}

/// Polls the statistics until `pred` holds (at most 10 s).
pub fn wait_stats(
    path: &Path,
    what: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let st = stats(path);
        if pred(&st) {
            return st;
        }
        assert!(std::time::Instant::now() < deadline, "{what}: {st}");
        thread::sleep(Duration::from_millis(10));
    }
}
