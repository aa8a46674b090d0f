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
//! | `x-query-bounce` | per device: `id`, `driver`, `stats` (`VirtioDevice::stats`: device counters, `dma` (what the device mapped: `maps`, `bytes`, `map_failures`, `unmaps`) and `bounce`, its own pool's statistics or `{"pool": NAME}` for a shared pool); then per shared pool: `pool`, `devices` (ids), `stats` (the pool's statistics) |
//! | `x-query-vcpus` | per vCPU: `cpu-index`, `thread-id`, `thread-state`, `answered`, `exits` by reason, `unhandled`; when its thread answered within 500 ms: `mp-state`, `regs`, `interrupts-enabled`, `sregs`, `events`, `lapic`, `msrs` ([`crate::vcpu::state`]) |
//! | `human-monitor-command` | `command-line` `info registers` (vCPU `cpu-index`, default 0) or `info registers -a`: the `x-query-vcpus` data as text |
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
//!
//! This module is the session: the socket, the client, events and shutdown causes. `framing`
//! splits a client's bytes into JSON values, bounded in size and nesting; `commands` checks
//! each value's envelope and answers it.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use crate::exit::{ExitHandle, ExitReason};
use crate::legacy::PowerButton;
use crate::virtio_pci::SharedVirtioDevice;

mod commands;
mod framing;
mod hmp;

pub use commands::{device_stats, greeting, version, COMMANDS};
use commands::{execute, generic, After};
use framing::{Frame, Framer};

/// The largest QMP command accepted, in bytes; a larger one is answered with an error and
/// skipped.
pub const MAX_COMMAND_BYTES: usize = 64 << 10;
/// The deepest JSON nesting accepted in a command.
pub const MAX_NESTING: usize = 64;
/// How long writing one reply or event to a client may block (a client that does not read
/// must not stall the VMM).
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(1);

/// A drive as `query-block` reports it.
#[derive(Clone, Debug)]
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
#[derive(Clone, Debug)]
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
    /// The vCPUs' shared blocks (thread ids, thread states, exit counters, state requests).
    pub vcpus: Arc<[crate::vcpu::VcpuShared]>,
    /// The ACPI power button (none with `-no-acpi`).
    pub power_button: Option<PowerButton>,
    /// The shared bounce pools (`-bounce ...,pool=NAME`), listed once each by
    /// `x-query-bounce`.
    pub pools: Arc<devices::pools::PoolRegistry>,
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

#[cfg(test)]
mod tests {
    use super::*;

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
