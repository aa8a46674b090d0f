//! A QMP monitor on a unix socket, speaking QEMU's JSON protocol for a small command set.
//!
//! One client at a time. The server sends the greeting
//! `{"QMP": {"version": {...}, "capabilities": []}}`; the client must send
//! `qmp_capabilities` first. Commands (arguments, where any, as in QEMU's qapi schema):
//!
//! | command | reply |
//! |---|---|
//! | `qmp_capabilities` | `{}`; `enable` must be empty (no capability is offered) |
//! | `query-version` | `{"qemu": {"major", "minor", "micro"}, "package": "bouncevm-X.Y.Z"}` |
//! | `query-commands` | `[{"name": ...}, ...]` |
//! | `query-status` | `{"status": "running", "running": true, "singlestep": false}` |
//! | `query-name` | `{"name": ...}` (`{}` without `-name`) |
//! | `query-kvm` | `{"enabled": true, "present": true}` |
//! | `query-cpus-fast` | per vCPU: `cpu-index`, `qom-path`, `thread-id`, `props` (socket/core/thread ids), `target` |
//! | `query-block` | one entry per drive: `device`, `qdev`, `inserted: {file, drv, ro}` |
//! | `query-blockstats` | per drive: `device`, `qdev`, `stats` from the device counters (`rd_bytes`, `wr_bytes`, `rd_operations`, `wr_operations`, `flush_operations`, `unmap_operations`) |
//! | `system_powerdown` | `{}` and a `POWERDOWN` event; presses the ACPI power button (see below) |
//! | `x-exit-now` | `{}`; the VM ends from the host side at once (vCPUs stopped, disks flushed), status 0 |
//! | `quit` | `{}`; the VM ends the same way, status 0 |
//! | `x-query-bounce` | per device: `id`, `driver`, `stats` (`VirtioDevice::stats`: device counters and the bounce pool's statistics) |
//! | `x-reset-bounce` | resets the bounce pools' high-water marks, lock counters and time histograms (`arguments: {"id": ID}` for one device); returns `{"reset": [ids of the pools reset]}`, or `DeviceNotFound` for an unknown id |
//!
//! Errors use QEMU's classes: `CommandNotFound` for unknown commands (and before
//! negotiation), `GenericError` for bad input (unexpected arguments: "Parameter 'x' is
//! unexpected"; malformed JSON; a command over [`MAX_COMMAND_BYTES`]); the session stays open
//! after each. An `id` member is echoed in the reply.
//!
//! Events: `POWERDOWN` (on `system_powerdown`), `SHUTDOWN` with `guest` and a qapi
//! `ShutdownCause` when the VM ends (`guest-shutdown` for ACPI S5 and other guest power-offs,
//! `guest-reset` for a reset, `guest-panic`, `host-qmp-quit` for `quit`/`x-exit-now`,
//! `host-signal` for SIGTERM/SIGINT, `host-ui` for Ctrl-A x, `host-error`).
//!
//! **`system_powerdown` presses the ACPI power button**, as in QEMU: the fixed-feature
//! PWRBTN_STS bit is set in PM1a_STS and, when the guest enabled it in PM1a_EN, the SCI is
//! raised ([`crate::legacy::PowerButton`]). An ACPI-aware guest (Linux with its `button`
//! driver and something acting on KEY_POWER, e.g. systemd-logind or acpid) then shuts down
//! and enters S5, which ends the VM with a `SHUTDOWN` (`guest-shutdown`) event. A guest that
//! ignores the button keeps running; `x-exit-now` ends it from the host.
//!
//! The socket is created mode 0600 unless told otherwise ([`bouncevm_common::sock`]), never replaces a
//! socket a live process serves, and a client that sends nothing never delays the VMM's exit
//! ([`Monitor::close`] shuts its connection down).

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Map, Value};

use crate::exit::{ExitHandle, ExitReason};
use crate::legacy::PowerButton;
use crate::virtio_pci::SharedVirtioDevice;

/// The largest QMP command accepted, in bytes; a larger one is answered with an error and
/// skipped.
pub const MAX_COMMAND_BYTES: usize = 64 << 10;
/// The deepest JSON nesting accepted in a command.
pub const MAX_NESTING: usize = 64;
/// How long writing one reply or event to a client may block (a client that does not read
/// must not stall the VMM).
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(1);

/// A drive as `query-block` reports it.
#[derive(Clone)]
pub struct BlockInfo {
    /// Drive id.
    pub id: String,
    /// The device using it.
    pub qdev: String,
    /// Image path.
    pub file: String,
    /// `raw` or `qcow2`.
    pub format: String,
    /// Read-only.
    pub readonly: bool,
    /// The device core (for `query-blockstats`).
    pub device: Option<SharedVirtioDevice>,
}

/// A device as `x-query-bounce` reports it.
#[derive(Clone)]
pub struct DeviceInfo {
    /// Device id.
    pub id: String,
    /// QEMU driver name (`virtio-blk-pci`, `virtio-net-pci`).
    pub driver: String,
    /// The device core.
    pub device: SharedVirtioDevice,
    /// The device's bounce pool, when it bounces (for `x-reset-bounce`).
    pub pool: Option<Arc<bounce::BouncePool>>,
}

impl std::fmt::Debug for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceInfo")
            .field("id", &self.id)
            .field("driver", &self.driver)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for BlockInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockInfo")
            .field("id", &self.id)
            .field("qdev", &self.qdev)
            .finish_non_exhaustive()
    }
}

/// What the monitor can see and do.
#[derive(Debug, Clone)]
pub struct QmpContext {
    /// Ends the VM.
    pub exit: ExitHandle,
    /// Drives.
    pub blocks: Vec<BlockInfo>,
    /// Devices.
    pub devices: Vec<DeviceInfo>,
    /// `-name`.
    pub name: Option<String>,
    /// The vCPU threads' ids (0 until a thread runs).
    pub vcpu_tids: Arc<[AtomicI32]>,
    /// The ACPI power button (none with `-no-acpi`).
    pub power_button: Option<PowerButton>,
}

/// Errors of the monitor socket.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// Binding the socket failed.
    #[error(transparent)]
    Bind(#[from] bouncevm_common::sock::SockError),
    /// Waiting for the first client failed.
    #[error("waiting for a QMP client: {0}")]
    Accept(#[source] std::io::Error),
}

/// qapi `ShutdownCause` values bouncevm reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownCause {
    /// The host VMM hit an error.
    HostError,
    /// QMP `quit` (or `x-exit-now`).
    HostQmpQuit,
    /// SIGTERM, SIGINT.
    HostSignal,
    /// The console escape (Ctrl-A x).
    HostUi,
    /// The guest powered off.
    GuestShutdown,
    /// The guest reset (bouncevm does not reboot, so a reset ends the VM).
    GuestReset,
    /// The guest reported a panic.
    GuestPanic,
}

impl ShutdownCause {
    /// The qapi name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::HostError => "host-error",
            Self::HostQmpQuit => "host-qmp-quit",
            Self::HostSignal => "host-signal",
            Self::HostUi => "host-ui",
            Self::GuestShutdown => "guest-shutdown",
            Self::GuestReset => "guest-reset",
            Self::GuestPanic => "guest-panic",
        }
    }

    /// Whether the guest caused it (the event's `guest` member).
    pub fn is_guest(self) -> bool {
        matches!(
            self,
            Self::GuestShutdown | Self::GuestReset | Self::GuestPanic
        )
    }
}

/// The monitor's shared state: the connected client (for events) and the cause of a
/// host-initiated stop.
#[derive(Debug, Default)]
pub struct Monitor {
    client: Mutex<Option<UnixStream>>,
    host_cause: Mutex<Option<ShutdownCause>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Monitor {
    /// A monitor with no client.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Ends the VM from the host with `cause` (the first request wins, as for any exit).
    pub fn stop(&self, exit: &ExitHandle, cause: ShutdownCause) {
        let mut c = lock(&self.host_cause);
        if c.is_none() && !exit.is_requested() {
            *c = Some(cause);
        }
        drop(c);
        exit.request(ExitReason::Stopped);
    }

    /// The `ShutdownCause` of a machine exit.
    pub fn cause_of(&self, reason: &ExitReason) -> ShutdownCause {
        match reason {
            ExitReason::PowerOff | ExitReason::Halted { .. } | ExitReason::DebugExit { .. } => {
                ShutdownCause::GuestShutdown
            }
            ExitReason::Reset | ExitReason::TripleFault => ShutdownCause::GuestReset,
            ExitReason::GuestCrash => ShutdownCause::GuestPanic,
            ExitReason::Error(_) => ShutdownCause::HostError,
            ExitReason::Stopped => lock(&self.host_cause).unwrap_or(ShutdownCause::HostQmpQuit),
        }
    }

    /// Sends `msg` to the connected client, if any (a failed write drops the client).
    fn send(&self, msg: &Value) {
        let mut c = lock(&self.client);
        if let Some(s) = c.as_mut() {
            let mut line = msg.to_string();
            line.push_str("\r\n");
            if s.write_all(line.as_bytes()).is_err() {
                let _ = s.shutdown(std::net::Shutdown::Both);
                *c = None;
            }
        }
    }

    /// Sends the event `name` to the connected client, if any.
    pub fn event(&self, name: &str, data: Value) {
        self.send(&event(name, data));
    }

    /// Sends the `SHUTDOWN` event for `reason`.
    pub fn shutdown_event(&self, reason: &ExitReason) {
        let cause = self.cause_of(reason);
        self.event(
            "SHUTDOWN",
            json!({"guest": cause.is_guest(), "reason": cause.as_str()}),
        );
    }

    /// Disconnects the client (its thread sees end-of-file); the VMM's exit never waits for
    /// a client.
    pub fn close(&self) {
        if let Some(s) = lock(&self.client).take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    fn attach(&self, s: &UnixStream) -> std::io::Result<()> {
        let w = s.try_clone()?;
        w.set_write_timeout(Some(WRITE_TIMEOUT))?;
        *lock(&self.client) = Some(w);
        Ok(())
    }

    fn detach(&self) {
        *lock(&self.client) = None;
    }
}

/// Binds the QMP socket at `path` with permission bits `mode`.
///
/// # Errors
/// [`QmpError::Bind`].
pub fn bind(
    path: &std::path::Path,
    mode: u32,
) -> Result<bouncevm_common::sock::BoundSocket, QmpError> {
    Ok(bouncevm_common::sock::BoundSocket::bind(path, mode)?)
}

/// Waits for the first client (`-qmp ...,server` without `nowait`); `None` when the VM was
/// asked to exit meanwhile (e.g. by SIGTERM).
///
/// # Errors
/// [`QmpError::Accept`].
pub fn wait_for_client(
    listener: &UnixListener,
    exit: &ExitHandle,
) -> Result<Option<UnixStream>, QmpError> {
    loop {
        let mut fds = [
            libc::pollfd {
                fd: listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: exit.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfds for the duration of the call.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(QmpError::Accept(e));
        }
        if exit.is_requested() {
            return Ok(None);
        }
        if fds[0].revents != 0 {
            return listener
                .accept()
                .map(|(s, _)| Some(s))
                .map_err(QmpError::Accept);
        }
    }
}

/// Serves clients one after the other on `listener`, forever (run it on its own thread).
/// `first` is a client already accepted (for `-qmp ...,server` with waiting).
pub fn serve(
    listener: UnixListener,
    first: Option<UnixStream>,
    ctx: QmpContext,
    monitor: Arc<Monitor>,
) {
    if let Some(s) = first {
        handle_client(s, &ctx, &monitor);
    }
    for stream in listener.incoming() {
        match stream {
            Ok(s) => handle_client(s, &ctx, &monitor),
            Err(e) => {
                tracing::warn!(error = %e, "QMP accept failed");
                return;
            }
        }
    }
}

fn event(name: &str, data: Value) -> Value {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    json!({
        "event": name,
        "data": data,
        "timestamp": {"seconds": now.as_secs(), "microseconds": now.subsec_micros()},
    })
}

fn error(class: &str, desc: impl Into<String>) -> Value {
    json!({"error": {"class": class, "desc": desc.into()}})
}

fn generic(desc: impl Into<String>) -> Value {
    error("GenericError", desc)
}

/// bouncevm's version as QEMU's `VersionInfo`.
pub fn version() -> Value {
    let v = env!("CARGO_PKG_VERSION");
    let mut parts = v.split('.').map(|p| p.parse::<u64>().unwrap_or(0));
    json!({
        "qemu": {"major": parts.next(), "minor": parts.next(), "micro": parts.next()},
        "package": format!("bouncevm-{v}"),
    })
}

/// Greeting sent on connect.
pub fn greeting() -> Value {
    json!({"QMP": {"version": version(), "capabilities": []}})
}

/// One framed piece of client input.
#[derive(Debug, PartialEq, Eq)]
enum Frame {
    /// A complete JSON value (or top-level garbage) to parse.
    Text(Vec<u8>),
    /// A value over [`MAX_COMMAND_BYTES`] or [`MAX_NESTING`], skipped.
    TooLarge,
}

/// Splits a byte stream into JSON values without holding more than [`MAX_COMMAND_BYTES`]:
/// tracks nesting outside strings; a top-level run of other characters ends at a newline
/// (so it can be answered as a syntax error and the session resynchronises).
#[derive(Debug, Default)]
struct Framer {
    buf: Vec<u8>,
    depth: usize,
    in_string: bool,
    escape: bool,
    skipping: bool,
}

impl Framer {
    fn push(&mut self, b: u8, out: &mut Vec<Frame>) {
        if self.in_string {
            if self.escape {
                self.escape = false;
            } else if b == b'\\' {
                self.escape = true;
            } else if b == b'"' {
                self.in_string = false;
            }
            self.keep(b);
            return;
        }
        match b {
            b'{' | b'[' => {
                if self.depth == 0 && !self.buf.is_empty() {
                    // Garbage before a value.
                    out.push(Frame::Text(std::mem::take(&mut self.buf)));
                }
                self.depth += 1;
                if self.depth > MAX_NESTING {
                    self.skipping = true;
                }
                self.keep(b);
            }
            b'}' | b']' if self.depth > 0 => {
                self.depth -= 1;
                self.keep(b);
                if self.depth == 0 {
                    self.end(out);
                }
            }
            b'"' => {
                self.in_string = true;
                self.keep(b);
            }
            b'\n' if self.depth == 0 => {
                if !self.buf.iter().all(u8::is_ascii_whitespace) {
                    self.end(out);
                } else {
                    self.buf.clear();
                }
            }
            _ => self.keep(b),
        }
    }

    fn keep(&mut self, b: u8) {
        if self.skipping {
            return;
        }
        if self.buf.len() >= MAX_COMMAND_BYTES {
            self.skipping = true;
            self.buf = Vec::new();
            return;
        }
        self.buf.push(b);
    }

    fn end(&mut self, out: &mut Vec<Frame>) {
        if self.skipping {
            out.push(Frame::TooLarge);
        } else {
            out.push(Frame::Text(std::mem::take(&mut self.buf)));
        }
        self.buf.clear();
        self.skipping = false;
        self.in_string = false;
        self.escape = false;
        self.depth = 0;
    }
}

fn handle_client(stream: UnixStream, ctx: &QmpContext, monitor: &Monitor) {
    if monitor.attach(&stream).is_err() {
        return;
    }
    monitor.send(&greeting());
    let mut negotiated = false;
    let mut framer = Framer::default();
    let mut reader = stream;
    let mut buf = [0u8; 4096];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut frames = Vec::new();
        for &b in &buf[..n] {
            framer.push(b, &mut frames);
        }
        for f in frames {
            let reply = match f {
                Frame::TooLarge => generic(format!(
                    "JSON parse error, command exceeds {MAX_COMMAND_BYTES} bytes or {MAX_NESTING} levels of nesting"
                )),
                Frame::Text(t) => match serde_json::from_slice::<Value>(&t) {
                    Err(e) => generic(format!("JSON parse error, {e}")),
                    Ok(msg) => {
                        let (mut reply, after) = execute(&msg, ctx, &mut negotiated);
                        if let (Some(id), Some(obj)) = (msg.get("id"), reply.as_object_mut()) {
                            obj.insert("id".into(), id.clone());
                        }
                        monitor.send(&reply);
                        match after {
                            After::Nothing => {}
                            After::PowerDown => {
                                monitor.event("POWERDOWN", json!({}));
                                if let Some(b) = &ctx.power_button {
                                    b.press();
                                }
                            }
                            After::Quit => {
                                // The SHUTDOWN event follows from the VMM's exit path.
                                monitor.stop(&ctx.exit, ShutdownCause::HostQmpQuit);
                            }
                        }
                        continue;
                    }
                },
            };
            monitor.send(&reply);
        }
    }
    monitor.detach();
}

enum After {
    Nothing,
    PowerDown,
    Quit,
}

/// The commands, in `query-commands` order.
pub const COMMANDS: &[&str] = &[
    "qmp_capabilities",
    "query-commands",
    "query-version",
    "query-status",
    "query-name",
    "query-kvm",
    "query-cpus-fast",
    "query-block",
    "query-blockstats",
    "system_powerdown",
    "x-exit-now",
    "quit",
    "x-query-bounce",
    "x-reset-bounce",
];

/// The arguments `cmd` takes (all optional here).
fn arguments_of(cmd: &str) -> &'static [&'static str] {
    match cmd {
        "qmp_capabilities" => &["enable"],
        // QEMU's query-blockstats takes `query-nodes`; bouncevm reports devices only.
        "query-blockstats" => &["query-nodes"],
        "x-reset-bounce" => &["id"],
        _ => &[],
    }
}

/// Checks the envelope (`execute`, `arguments`, `id`) as QEMU's dispatcher does.
fn envelope(msg: &Value) -> Result<(&str, Map<String, Value>), Value> {
    let Some(obj) = msg.as_object() else {
        return Err(generic("QMP input must be a JSON object"));
    };
    for k in obj.keys() {
        if !matches!(k.as_str(), "execute" | "arguments" | "id") {
            return Err(generic(format!("QMP input member '{k}' is unexpected")));
        }
    }
    let cmd = match obj.get("execute") {
        None => return Err(generic("QMP input lacks member 'execute'")),
        Some(Value::String(s)) => s.as_str(),
        Some(_) => return Err(generic("QMP input member 'execute' must be a string")),
    };
    let args = match obj.get("arguments") {
        None => Map::new(),
        Some(Value::Object(a)) => a.clone(),
        Some(_) => return Err(generic("QMP input member 'arguments' must be an object")),
    };
    Ok((cmd, args))
}

fn execute(msg: &Value, ctx: &QmpContext, negotiated: &mut bool) -> (Value, After) {
    let (cmd, args) = match envelope(msg) {
        Ok(x) => x,
        Err(e) => return (e, After::Nothing),
    };
    if !*negotiated && cmd != "qmp_capabilities" {
        return (
            error(
                "CommandNotFound",
                "Expecting capabilities negotiation with 'qmp_capabilities'",
            ),
            After::Nothing,
        );
    }
    if !COMMANDS.contains(&cmd) {
        return (
            error(
                "CommandNotFound",
                format!("The command {cmd} has not been found"),
            ),
            After::Nothing,
        );
    }
    if let Some(k) = args
        .keys()
        .find(|k| !arguments_of(cmd).contains(&k.as_str()))
    {
        return (
            generic(format!("Parameter '{k}' is unexpected")),
            After::Nothing,
        );
    }
    let ok = |v: Value| (json!({ "return": v }), After::Nothing);
    match cmd {
        "qmp_capabilities" => capabilities(&args, negotiated),
        "query-commands" => ok(COMMANDS.iter().map(|c| json!({"name": c})).collect()),
        "query-version" => ok(version()),
        "query-status" => ok(json!({"status": "running", "running": true, "singlestep": false})),
        "query-name" => ok(match &ctx.name {
            Some(n) => json!({"name": n}),
            None => json!({}),
        }),
        "query-kvm" => ok(json!({"enabled": true, "present": true})),
        "query-cpus-fast" => ok(ctx
            .vcpu_tids
            .iter()
            .enumerate()
            .map(|(i, tid)| {
                json!({
                    "cpu-index": i,
                    "qom-path": format!("/machine/unattached/device[{i}]"),
                    "thread-id": tid.load(Ordering::Relaxed),
                    "props": {"socket-id": 0, "core-id": i, "thread-id": 0},
                    "target": "x86_64",
                })
            })
            .collect()),
        "query-block" => ok(ctx.blocks.iter().map(block_info).collect()),
        "query-blockstats" => ok(ctx.blocks.iter().map(block_stats).collect()),
        "x-query-bounce" => ok(ctx
            .devices
            .iter()
            .map(|d| {
                let stats = d.device.lock().map(|g| g.stats()).unwrap_or(Value::Null);
                json!({"id": d.id, "driver": d.driver, "stats": stats})
            })
            .collect()),
        "x-reset-bounce" => reset_bounce(&args, ctx),
        "system_powerdown" => (json!({"return": {}}), After::PowerDown),
        "quit" | "x-exit-now" => (json!({"return": {}}), After::Quit),
        _ => unreachable!("every name in COMMANDS is handled"),
    }
}

/// `x-reset-bounce [id]`: resets the pools' high-water marks, lock counters and time
/// histograms (all devices, or the one named); answers the ids whose pool was reset.
fn reset_bounce(args: &Map<String, Value>, ctx: &QmpContext) -> (Value, After) {
    let want = match args.get("id") {
        None => None,
        Some(Value::String(id)) => Some(id.as_str()),
        Some(_) => {
            return (
                generic("Invalid parameter type for 'id', expected: string"),
                After::Nothing,
            )
        }
    };
    let chosen: Vec<&DeviceInfo> = ctx
        .devices
        .iter()
        .filter(|d| want.is_none_or(|w| d.id == w))
        .collect();
    if let (Some(w), true) = (want, chosen.is_empty()) {
        return (
            error("DeviceNotFound", format!("Device '{w}' not found")),
            After::Nothing,
        );
    }
    let reset: Vec<&str> = chosen
        .iter()
        .filter_map(|d| {
            d.pool.as_ref().map(|p| {
                p.reset_hiwater();
                d.id.as_str()
            })
        })
        .collect();
    (json!({ "return": { "reset": reset } }), After::Nothing)
}

/// `qmp_capabilities`: refused once negotiated, and with any capability in `enable` (none
/// is offered).
fn capabilities(args: &Map<String, Value>, negotiated: &mut bool) -> (Value, After) {
    if *negotiated {
        return (
            error(
                "CommandNotFound",
                "Capabilities negotiation is already complete, command ignored",
            ),
            After::Nothing,
        );
    }
    match args.get("enable") {
        None => {}
        Some(Value::Array(caps)) => {
            if let Some(c) = caps.first() {
                let name = c.as_str().map_or_else(|| c.to_string(), str::to_string);
                return (
                    generic(format!("Capability '{name}' not available")),
                    After::Nothing,
                );
            }
        }
        Some(_) => {
            return (
                generic("Invalid parameter type for 'enable', expected: array"),
                After::Nothing,
            )
        }
    }
    *negotiated = true;
    (json!({"return": {}}), After::Nothing)
}

fn block_info(b: &BlockInfo) -> Value {
    json!({
        "device": b.id,
        "qdev": b.qdev,
        "removable": false,
        "locked": false,
        "type": "unknown",
        "inserted": {
            "file": b.file,
            "drv": b.format,
            "ro": b.readonly,
            "encrypted": false,
            "backing_file_depth": 0,
        },
    })
}

/// `BlockStats` from the device's counters (`VirtioDevice::stats()["metrics"]`).
fn block_stats(b: &BlockInfo) -> Value {
    let stats = b
        .device
        .as_ref()
        .and_then(|d| d.lock().ok().map(|g| g.stats()))
        .unwrap_or(Value::Null);
    let m = &stats["metrics"];
    let n = |k: &str| m[k].as_u64().unwrap_or(0);
    json!({
        "device": b.id,
        "qdev": b.qdev,
        "stats": {
            "rd_bytes": n("bytes_read"),
            "wr_bytes": n("bytes_written"),
            "rd_operations": n("reqs_in"),
            "wr_operations": n("reqs_out"),
            "flush_operations": n("reqs_flush"),
            "unmap_operations": n("reqs_discard"),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(input: &[u8]) -> Vec<Frame> {
        let mut f = Framer::default();
        let mut out = Vec::new();
        for &b in input {
            f.push(b, &mut out);
        }
        out
    }

    #[test]
    fn framer_splits_values_and_bounds_them() {
        let t = |s: &str| Frame::Text(s.as_bytes().to_vec());
        assert_eq!(
            frames(br#"{"a": "}{"}{"b": [1, {"c": "\""}]}"#),
            vec![t(r#"{"a": "}{"}"#), t(r#"{"b": [1, {"c": "\""}]}"#)]
        );
        assert_eq!(frames(b"garbage\n{}"), vec![t("garbage"), t("{}")]);
        assert_eq!(frames(b"  \r\n\n"), vec![]);
        let mut big = b"{\"execute\": \"".to_vec();
        big.resize(MAX_COMMAND_BYTES + 10, b'x');
        big.extend(b"\"}{}");
        assert_eq!(frames(&big), vec![Frame::TooLarge, t("{}")]);
        let deep = "[".repeat(MAX_NESTING + 1) + &"]".repeat(MAX_NESTING + 1);
        assert_eq!(frames(deep.as_bytes()), vec![Frame::TooLarge]);
    }

    fn ctx() -> QmpContext {
        QmpContext {
            exit: ExitHandle::new().unwrap(),
            blocks: Vec::new(),
            devices: Vec::new(),
            name: Some("vm1".into()),
            vcpu_tids: Arc::from(vec![AtomicI32::new(7)]),
            power_button: None,
        }
    }

    /// `x-reset-bounce` clears the high-water mark of the named pool (or all), answers the ids
    /// reset, and refuses an unknown id or a non-string one.
    #[test]
    fn x_reset_bounce_resets_the_pools_high_water_marks() {
        use bounce::{Direction, HostMemory, MapRequest};
        let img = std::env::temp_dir().join(format!("bvm-qmp-reset-{}.img", std::process::id()));
        std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
        let dev = |bounce: &str| {
            let b = devices::builder::block(
                &img,
                Some(devices::block::io::ImageFormat::Raw),
                true,
                devices::block::BlockConfig::default(),
                &bounce.parse().unwrap(),
            )
            .unwrap();
            let device: SharedVirtioDevice = Arc::new(Mutex::new(b.device));
            (device, b.pool)
        };
        let (d0, p0) = dev("policy=force,slots=256");
        let (d1, p1) = dev("policy=off");
        let pool = p0.clone().unwrap();
        assert!(p1.is_none());
        let mut c = ctx();
        c.devices = vec![
            DeviceInfo {
                id: "blk0".into(),
                driver: "virtio-blk-pci".into(),
                device: d0,
                pool: p0,
            },
            DeviceInfo {
                id: "blk1".into(),
                driver: "virtio-blk-pci".into(),
                device: d1,
                pool: p1,
            },
        ];
        let mut buf = vec![0u8; 8192];
        let mem = HostMemory::new(0x1000, &mut buf);
        let m = pool
            .map(&mem, &MapRequest::new(0x1000, 8192, Direction::ToDevice))
            .unwrap();
        pool.unmap(&mem, &m, 0).unwrap();
        assert!(pool.stats().used_hiwater > 0);
        let mut neg = true;
        let mut ex = |v: Value| execute(&v, &c, &mut neg).0;
        let e = ex(json!({"execute": "x-reset-bounce", "arguments": {"id": "nope"}}));
        assert_eq!(e["error"]["class"], "DeviceNotFound");
        let e = ex(json!({"execute": "x-reset-bounce", "arguments": {"id": 3}}));
        assert_eq!(e["error"]["class"], "GenericError");
        assert!(
            pool.stats().used_hiwater > 0,
            "refused requests reset nothing"
        );
        let r = ex(json!({"execute": "x-reset-bounce", "arguments": {"id": "blk1"}}));
        assert_eq!(r["return"]["reset"], json!([]), "blk1 does not bounce");
        assert!(pool.stats().used_hiwater > 0);
        let r = ex(json!({"execute": "x-reset-bounce"}));
        assert_eq!(r["return"]["reset"], json!(["blk0"]));
        assert_eq!(pool.stats().used_hiwater, 0);
        let _ = std::fs::remove_file(&img);
    }

    #[test]
    fn commands_check_arguments_as_qemu_does() {
        let c = ctx();
        let mut neg = false;
        let mut ex = |v: Value| execute(&v, &c, &mut neg).0;
        assert_eq!(
            ex(json!({"execute": "query-version"}))["error"]["class"],
            "CommandNotFound"
        );
        let e = ex(json!({"execute": "qmp_capabilities", "arguments": {"enable": ["oob"]}}));
        assert_eq!(e["error"]["desc"], "Capability 'oob' not available");
        assert_eq!(
            ex(json!({"execute": "qmp_capabilities"}))["return"],
            json!({})
        );
        let e = ex(json!({"execute": "query-status", "arguments": {"x": 1}}));
        assert_eq!(e["error"]["class"], "GenericError");
        assert_eq!(e["error"]["desc"], "Parameter 'x' is unexpected");
        assert_eq!(
            ex(json!({"execute": "query-status", "foo": 1}))["error"]["class"],
            "GenericError"
        );
        assert_eq!(ex(json!([1]))["error"]["class"], "GenericError");
        assert_eq!(
            ex(json!({"execute": "query-name"}))["return"]["name"],
            "vm1"
        );
        assert_eq!(
            ex(json!({"execute": "query-cpus-fast"}))["return"][0]["thread-id"],
            7
        );
        assert_eq!(
            ex(json!({"execute": "query-kvm"}))["return"]["enabled"],
            true
        );
        let v = ex(json!({"execute": "query-version"}));
        assert_eq!(
            v["return"]["package"],
            format!("bouncevm-{}", env!("CARGO_PKG_VERSION"))
        );
        assert!(v["return"]["qemu"]["major"].is_u64());
        let cmds = ex(json!({"execute": "query-commands"}));
        assert_eq!(cmds["return"].as_array().unwrap().len(), COMMANDS.len());
        assert_eq!(
            ex(json!({"execute": "nope"}))["error"]["class"],
            "CommandNotFound"
        );
    }

    #[test]
    fn shutdown_causes_are_qapi_values() {
        let m = Monitor::default();
        let exit = ExitHandle::new().unwrap();
        assert_eq!(
            m.cause_of(&ExitReason::PowerOff),
            ShutdownCause::GuestShutdown
        );
        assert_eq!(m.cause_of(&ExitReason::Reset), ShutdownCause::GuestReset);
        m.stop(&exit, ShutdownCause::HostSignal);
        // A later host request does not overwrite the first cause.
        m.stop(&exit, ShutdownCause::HostQmpQuit);
        assert_eq!(m.cause_of(&ExitReason::Stopped), ShutdownCause::HostSignal);
        assert!(!ShutdownCause::HostSignal.is_guest());
        assert!(ShutdownCause::GuestReset.is_guest());
        // Every value is one of QEMU's qapi ShutdownCause names.
        let qapi = [
            "none",
            "host-error",
            "host-qmp-quit",
            "host-qmp-system-reset",
            "host-signal",
            "host-ui",
            "guest-shutdown",
            "guest-reset",
            "guest-panic",
            "subsystem-reset",
            "snapshot-load",
        ];
        for c in [
            ShutdownCause::HostError,
            ShutdownCause::HostQmpQuit,
            ShutdownCause::HostSignal,
            ShutdownCause::HostUi,
            ShutdownCause::GuestShutdown,
            ShutdownCause::GuestReset,
            ShutdownCause::GuestPanic,
        ] {
            assert!(qapi.contains(&c.as_str()));
        }
    }
}
