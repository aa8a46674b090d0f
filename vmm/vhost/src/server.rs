//! The vhost-user server: a listening socket, one frontend connection at a time, signals and
//! a statistics socket.
//!
//! Each connection gets a fresh [`VhostUserDevice`] adapter and a fresh
//! `vhost_user_backend::VhostUserDaemon` around the same device; the frontend's socket is
//! joined to the daemon's request handler through a [`Relay`] (which fixes QEMU's early
//! `SET_VRING_ENABLE`). When the frontend disconnects the device is reset and the server
//! accepts the next one.
//!
//! The main loop polls the listening socket (between connections), a stop event, an optional
//! signal fd (SIGINT/SIGTERM stop, SIGUSR1 prints statistics), an optional statistics socket
//! (each connection gets one JSON line) and the end of the current connection.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use bouncevm_common::SignalFd;
use devices::virtio::VirtioDevice;
use serde_json::{json, Value};
use vhost::vhost_user::Error as VhostUserError;
use vhost_user_backend::{Error as DaemonError, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::backend::{Memory, VhostUserDevice};
use crate::layout::{check_queue_count, LayoutError};
use crate::relay::{Relay, RelayCounters};
use devices::metrics::{lock, LogOnce};

/// Errors of the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Another process is listening on the socket.
    #[error("socket {0} is in use by a running server")]
    SocketInUse(PathBuf),
    /// The socket path exists and is not a socket.
    #[error("{0} exists and is not a socket")]
    NotASocket(PathBuf),
    /// The device cannot be served over vhost-user (too many queues).
    #[error("{0}")]
    Layout(#[from] LayoutError),
    /// Binding or preparing a socket failed.
    #[error("cannot listen on {path}: {source}")]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// An operating-system call of the main loop failed.
    #[error("{what}: {source}")]
    Os {
        /// What was being done.
        what: &'static str,
        /// The cause.
        source: io::Error,
    },
}

/// Result of the server.
pub type Result<T> = std::result::Result<T, ServerError>;

fn os(what: &'static str) -> impl FnOnce(io::Error) -> ServerError {
    move |source| ServerError::Os { what, source }
}

/// Binds a listening socket at `path` with mode 0600: refuses when a live server answers
/// there or the path is not a socket; replaces a stale socket file (see [`bouncevm_common::sock`]).
///
/// # Errors
/// [`ServerError::SocketInUse`], [`ServerError::NotASocket`], [`ServerError::Bind`].
pub fn bind_socket(path: &Path) -> Result<UnixListener> {
    bind_socket_mode(path, bouncevm_common::sock::DEFAULT_SOCKET_MODE)
}

/// [`bind_socket`] with permission bits `mode`.
///
/// # Errors
/// As [`bind_socket`].
pub fn bind_socket_mode(path: &Path, mode: u32) -> Result<UnixListener> {
    use bouncevm_common::sock::SockError;
    bouncevm_common::sock::bind_unix(path, mode).map_err(|e| match e {
        SockError::InUse(p) => ServerError::SocketInUse(p),
        SockError::NotASocket(p) => ServerError::NotASocket(p),
        SockError::Bind { path, source } => ServerError::Bind { path, source },
    })
}

/// A handle that stops a running [`Server::run`] from another thread.
#[derive(Debug)]
pub struct StopHandle(EventFd);

impl StopHandle {
    /// Asks the server to stop (it closes the current connection and returns).
    pub fn stop(&self) {
        let _ = self.0.write(1);
    }
}

/// A handle that makes a running [`Server::run`] print its statistics line to stderr, from
/// another thread (the server that takes SIGUSR1 passes it on to the other devices of its
/// process).
#[derive(Debug)]
pub struct PrintHandle(EventFd);

impl PrintHandle {
    /// Asks the server to print its statistics.
    pub fn print(&self) {
        let _ = self.0.write(1);
    }
}

/// The servers that print their statistics along with the one that takes SIGUSR1: the other
/// devices of one process, added once they are bound.
pub type PrintPeers = Arc<Mutex<Vec<PrintHandle>>>;

/// Where a statistics source comes from: a name and a closure producing JSON.
type StatsSource = (String, Box<dyn Fn() -> Value + Send>);

/// The connection being served.
struct Connection {
    frontend: UnixStream,
    done: EventFd,
    thread: JoinHandle<()>,
}

/// Counters kept across connections.
#[derive(Debug, Default)]
struct ServerCounters {
    connections: AtomicU64,
    failed_connections: AtomicU64,
    /// Sessions the backend ended on a front end's protocol error (logged once).
    failed_sessions: AtomicU64,
    failed_session_logged: LogOnce,
    relay: Arc<RelayCounters>,
    /// The adapters' transport counters, shared by every connection's adapter.
    transport: Arc<crate::backend::Counters>,
}

/// A vhost-user server for one device.
pub struct Server<D> {
    name: String,
    device: Arc<Mutex<D>>,
    socket: PathBuf,
    listener: UnixListener,
    stats_socket: Option<(PathBuf, UnixListener)>,
    sources: Vec<StatsSource>,
    /// Run when a statistics client sends `reset` (high-water marks, histograms).
    resets: Vec<Box<dyn Fn() + Send>>,
    stop: EventFd,
    print: EventFd,
    signals: Option<SignalFd>,
    peers: PrintPeers,
    /// The adapter of the current (or last) connection.
    current: Option<Arc<VhostUserDevice<D>>>,
    connected: bool,
    counters: Arc<ServerCounters>,
    started: Instant,
}

impl<D> std::fmt::Debug for Server<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("name", &self.name)
            .field("socket", &self.socket)
            .finish_non_exhaustive()
    }
}

/// What the main loop polls.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Source {
    Stop,
    Print,
    Signal,
    Stats,
    Accept,
    Done,
}

impl<D: VirtioDevice<Memory> + 'static> Server<D> {
    /// Listens on `socket` for `device`.
    ///
    /// # Errors
    /// [`ServerError::Layout`] for a device with more queues than vhost-user can serve (before
    /// the socket is touched); as [`bind_socket`]; [`ServerError::Os`] when the stop event
    /// cannot be created.
    pub fn bind(name: &str, device: D, socket: &Path) -> Result<Self> {
        Self::bind_mode(
            name,
            device,
            socket,
            bouncevm_common::sock::DEFAULT_SOCKET_MODE,
        )
    }

    /// [`Server::bind`] with the socket's permission bits `mode`.
    ///
    /// # Errors
    /// As [`Server::bind`].
    pub fn bind_mode(name: &str, device: D, socket: &Path, mode: u32) -> Result<Self> {
        check_queue_count(device.num_queues())?;
        let listener = bind_socket_mode(socket, mode)?;
        let stop = EventFd::new(EFD_NONBLOCK).map_err(os("creating the stop event"))?;
        let print = EventFd::new(EFD_NONBLOCK).map_err(os("creating the print event"))?;
        Ok(Self {
            name: name.to_string(),
            device: Arc::new(Mutex::new(device)),
            socket: socket.to_path_buf(),
            listener,
            stats_socket: None,
            sources: Vec::new(),
            resets: Vec::new(),
            stop,
            print,
            signals: None,
            peers: PrintPeers::default(),
            current: None,
            connected: false,
            counters: Arc::default(),
            started: Instant::now(),
        })
    }

    /// Also answers one JSON line of statistics to each connection on `path`.
    ///
    /// # Errors
    /// As [`bind_socket`].
    pub fn with_stats_socket(self, path: &Path) -> Result<Self> {
        self.with_stats_socket_mode(path, bouncevm_common::sock::DEFAULT_SOCKET_MODE)
    }

    /// [`Server::with_stats_socket`] with the socket's permission bits `mode`.
    ///
    /// # Errors
    /// As [`bind_socket`].
    pub fn with_stats_socket_mode(mut self, path: &Path, mode: u32) -> Result<Self> {
        let l = bind_socket_mode(path, mode)?;
        self.stats_socket = Some((path.to_path_buf(), l));
        Ok(self)
    }

    /// Handles SIGINT/SIGTERM (stop) and SIGUSR1 (statistics to stderr) through `signals`.
    pub fn with_signals(mut self, signals: SignalFd) -> Self {
        self.signals = Some(signals);
        self
    }

    /// On SIGUSR1, also asks `peers` to print theirs.
    pub fn with_print_peers(mut self, peers: PrintPeers) -> Self {
        self.peers = peers;
        self
    }

    /// Adds a statistics source shown under `name` (e.g. the bounce pool).
    pub fn with_stats_source(
        mut self,
        name: &str,
        source: impl Fn() -> Value + Send + 'static,
    ) -> Self {
        self.sources.push((name.to_string(), Box::new(source)));
        self
    }

    /// Adds what a statistics client's `reset` request runs (e.g. the bounce pool's
    /// `reset_hiwater`).
    pub fn with_reset(mut self, reset: impl Fn() + Send + 'static) -> Self {
        self.resets.push(Box::new(reset));
        self
    }

    /// A handle that stops [`Server::run`].
    ///
    /// # Errors
    /// The event could not be duplicated.
    pub fn stop_handle(&self) -> io::Result<StopHandle> {
        self.stop.try_clone().map(StopHandle)
    }

    /// A handle that makes [`Server::run`] print the statistics.
    ///
    /// # Errors
    /// The event could not be duplicated.
    pub fn print_handle(&self) -> io::Result<PrintHandle> {
        self.print.try_clone().map(PrintHandle)
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The statistics as JSON: the device's (with the current connection's workers and
    /// state, and the transport counters of all connections), the extra sources and the
    /// server's own counters.
    pub fn stats(&self) -> Value {
        let mut v = match &self.current {
            Some(adapter) => adapter.stats(),
            None => json!({ "device": lock(&self.device).stats() }),
        };
        let c = &self.counters;
        let relay = c.relay.snapshot();
        v["server"] = json!({
            "name": self.name,
            "socket": self.socket,
            "uptime_s": self.started.elapsed().as_secs_f64(),
            "connections": c.connections.load(Ordering::Relaxed),
            "failed_connections": c.failed_connections.load(Ordering::Relaxed),
            "failed_sessions": c.failed_sessions.load(Ordering::Relaxed),
            "connected": self.connected,
            "relay": relay,
        });
        for (name, f) in &self.sources {
            v[name.as_str()] = f();
        }
        v
    }

    /// Serves frontends one after another until stopped (stop handle, SIGINT or SIGTERM).
    ///
    /// # Errors
    /// [`ServerError::Os`] when polling or accepting fails beyond recovery. A connection that
    /// fails to start is logged and the next one is accepted.
    pub fn run(&mut self) -> Result<()> {
        let mut conn: Option<Connection> = None;
        let mut stopping = false;
        while !stopping {
            let mut sources = vec![
                (Source::Stop, self.stop.as_raw_fd()),
                (Source::Print, self.print.as_raw_fd()),
            ];
            if let Some(s) = &self.signals {
                sources.push((Source::Signal, s.as_raw_fd()));
            }
            if let Some((_, l)) = &self.stats_socket {
                sources.push((Source::Stats, l.as_raw_fd()));
            }
            match &conn {
                Some(c) => sources.push((Source::Done, c.done.as_raw_fd())),
                None => sources.push((Source::Accept, self.listener.as_raw_fd())),
            }
            for source in poll(&sources, -1).map_err(os("polling"))? {
                match source {
                    Source::Stop => {
                        let _ = self.stop.read();
                        stopping = true;
                    }
                    Source::Signal => {
                        while let Some(sig) = self.signals.as_ref().and_then(SignalFd::read) {
                            match sig {
                                libc::SIGUSR1 => {
                                    eprintln!("{}", self.stats());
                                    lock(&self.peers).iter().for_each(PrintHandle::print);
                                }
                                libc::SIGINT | libc::SIGTERM => {
                                    tracing::info!("signal {sig}: stopping");
                                    stopping = true;
                                }
                                _ => {}
                            }
                        }
                    }
                    Source::Print => {
                        let _ = self.print.read();
                        eprintln!("{}", self.stats());
                    }
                    Source::Stats => self.answer_stats(),
                    Source::Accept => match self.listener.accept() {
                        Ok((stream, _)) => match self.start_connection(stream) {
                            Ok(c) => {
                                conn = Some(c);
                                self.connected = true;
                            }
                            Err(e) => {
                                self.counters
                                    .failed_connections
                                    .fetch_add(1, Ordering::Relaxed);
                                tracing::error!("cannot serve the new connection: {e}");
                            }
                        },
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(os("accepting a connection")(e)),
                    },
                    Source::Done => {
                        if let Some(c) = conn.take() {
                            let _ = c.thread.join();
                        }
                        self.connected = false;
                        tracing::info!("frontend disconnected; waiting for the next one");
                    }
                }
            }
        }
        if let Some(c) = conn.take() {
            let _ = c.frontend.shutdown(std::net::Shutdown::Both);
            // The session winds down once its sockets are shut; don't hang on a stuck one.
            let deadline = Instant::now() + Duration::from_secs(5);
            while !c.thread.is_finished() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(10));
            }
            if c.thread.is_finished() {
                let _ = c.thread.join();
            } else {
                tracing::warn!("the session did not end within 5 s; leaving it behind");
            }
        }
        Ok(())
    }

    /// Writes one JSON line to a statistics client.
    fn answer_stats(&self) {
        let Some((_, l)) = &self.stats_socket else {
            return;
        };
        if let Ok((mut s, _)) = l.accept() {
            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
            // A client may send "reset\n" first (within 20 ms): the reset hooks run, then the
            // statistics after the reset are answered with "reset": true.
            let _ = s.set_read_timeout(Some(Duration::from_millis(20)));
            let mut req = [0u8; 16];
            let reset = matches!(std::io::Read::read(&mut s, &mut req), Ok(n) if req[..n].trim_ascii() == b"reset");
            if reset {
                self.resets.iter().for_each(|r| r());
            }
            let mut v = self.stats();
            if reset {
                v["reset"] = json!(true);
            }
            let line = format!("{v}\n");
            if let Err(e) = s.write_all(line.as_bytes()) {
                tracing::debug!("statistics client: {e}");
            }
        }
    }

    /// Starts serving `frontend`: a new adapter and daemon, a relay, and a thread that waits
    /// for the end of the session and resets the device.
    fn start_connection(&mut self, frontend: UnixStream) -> io::Result<Connection> {
        let n = self.counters.connections.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::info!("frontend connected (connection {n})");
        let adapter = Arc::new(
            VhostUserDevice::shared(self.device.clone())
                .counting_into(self.counters.transport.clone()),
        );
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<()>::new());
        let mut daemon = match VhostUserDaemon::new(self.name.clone(), adapter.clone(), mem) {
            Ok(d) => d,
            Err(e) => {
                close_exit_consumers(&adapter);
                return Err(io::Error::other(format!("creating the daemon: {e}")));
            }
        };
        adapter.attach(daemon.get_epoll_handlers());
        let backend = match connect_daemon(&mut daemon, n) {
            Ok(b) => b,
            Err(e) => {
                end_daemon(daemon, &adapter);
                return Err(e);
            }
        };
        let relay = match Relay::start(
            frontend,
            backend,
            adapter.limits(),
            adapter.report(),
            self.counters.relay.clone(),
        ) {
            Ok(r) => r,
            Err(e) => {
                end_daemon(daemon, &adapter);
                return Err(e);
            }
        };
        let handle = relay.frontend_handle()?;
        let done = EventFd::new(EFD_NONBLOCK)?;
        let done2 = done.try_clone()?;
        let counters = self.counters.clone();
        let session_adapter = adapter.clone();
        let thread = thread::Builder::new()
            .name(format!("vu-session-{n}"))
            .spawn(move || {
                let result = daemon.wait();
                relay.join();
                end_daemon(daemon, &session_adapter);
                match result {
                    Ok(())
                    | Err(DaemonError::HandleRequest(
                        VhostUserError::Disconnected
                        | VhostUserError::PartialMessage
                        | VhostUserError::SocketBroken(_),
                    )) => tracing::debug!("session {n} ended"),
                    Err(e) => {
                        counters.failed_sessions.fetch_add(1, Ordering::Relaxed);
                        if counters.failed_session_logged.first() {
                            tracing::warn!(
                                "session {n} ended: {e} (logged once, counted in failed_sessions)"
                            );
                        } else {
                            tracing::debug!("session {n} ended: {e}");
                        }
                    }
                }
                let _ = done2.write(1);
            })?;
        self.current = Some(adapter);
        Ok(Connection {
            frontend: handle,
            done,
            thread,
        })
    }
}

impl<D> Drop for Server<D> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
        if let Some((p, _)) = &self.stats_socket {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Ends a session's daemon: tells its epoll threads to exit, resets the adapter's device
/// (which drops the adapter's references to the epoll handlers), drops the daemon (its drop
/// joins the epoll threads) and closes the exit events `vhost-user-backend` leaves open.
fn end_daemon<D: VirtioDevice<Memory> + 'static>(
    daemon: VhostUserDaemon<Arc<VhostUserDevice<D>>>,
    adapter: &VhostUserDevice<D>,
) {
    for h in daemon.get_epoll_handlers() {
        h.send_exit_event();
    }
    adapter.detach();
    drop(daemon);
    close_exit_consumers(adapter);
}

/// Closes the exit-event consumers the adapter gave its (dropped) daemon.
///
/// `vhost-user-backend` 0.24 registers each on its epoll fd with `into_raw_fd` and never
/// closes it: one eventfd per epoll thread per connection stayed open, and after some
/// thousands of connections (a front end reconnecting, or a hostile one) the server had no
/// descriptors left and refused every new one (found by `tests/vhost_fuzz.rs`).
fn close_exit_consumers<D: VirtioDevice<Memory> + 'static>(adapter: &VhostUserDevice<D>) {
    for fd in adapter.take_exit_consumers() {
        // SAFETY: `fd` is an eventfd vhost-user-backend took with `into_raw_fd` and keeps no
        // copy of (it only passed the number to `epoll_ctl`); it is taken from the adapter once,
        // so nothing else owns or closes it. Should an epoll thread still be waiting, its
        // handler's notifier (a duplicate of the same eventfd) keeps the registration alive.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
    }
}

/// Connects the daemon's request handler to a private socket and returns our end.
fn connect_daemon<D: VirtioDevice<Memory> + 'static>(
    daemon: &mut VhostUserDaemon<Arc<VhostUserDevice<D>>>,
    n: u64,
) -> io::Result<UnixStream> {
    // Unique in the process, not only per server: two servers in one process (an embedding,
    // or parallel tests) numbered their connections alike and removed each other's socket.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let unique = NEXT.fetch_add(1, Ordering::Relaxed);
    // mkdtemp: a 0700 directory with an unpredictable name (a predictable name under /tmp
    // lets another user pre-create it or race the bind).
    let dir = bouncevm_common::sock::private_dir(&format!(
        "bouncevm-vhost.{}.{n}.{unique}.",
        std::process::id()
    ))?;
    let path = dir.join("s");
    let result = (|| {
        let listener = UnixListener::bind(&path)?;
        let p = path
            .to_str()
            .ok_or_else(|| io::Error::other("temporary path is not UTF-8"))?;
        daemon
            .start_client(p)
            .map_err(|e| io::Error::other(format!("starting the request handler: {e}")))?;
        let (stream, _) = listener.accept()?;
        Ok(stream)
    })();
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_dir(&dir);
    result
}

/// Polls `sources` for input; returns the ready ones.
// devices::testing's driver builds its pollfds the same way; that one is test support in
// the devices crate (below this one), so the server keeps its own.
fn poll(sources: &[(Source, RawFd)], timeout_ms: i32) -> io::Result<Vec<Source>> {
    let mut fds: Vec<libc::pollfd> = sources
        .iter()
        .map(|&(_, fd)| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        // SAFETY: `fds` is a valid array of `fds.len()` pollfd structures.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
        if n >= 0 {
            break;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(fds
        .iter()
        .zip(sources)
        .filter(|(p, _)| p.revents != 0)
        .map(|(_, &(s, _))| s)
        .collect())
}
