//! A QMP monitor on a unix socket, speaking QEMU's JSON protocol for a small command set.
//!
//! One client at a time. The server sends the greeting
//! `{"QMP": {"version": {...}, "capabilities": []}}`; the client must send
//! `qmp_capabilities` first. Commands:
//!
//! | command | reply |
//! |---|---|
//! | `qmp_capabilities` | `{}` |
//! | `query-status` | `{"status": "running", "running": true, "singlestep": false}` |
//! | `query-block` | one entry per drive: `device`, `qdev`, `inserted: {file, drv, ro}` |
//! | `system_powerdown` | `{}`, then a `POWERDOWN` event, then the VM ends (see below) |
//! | `quit` | `{}`, then the VM ends with status 0 |
//! | `x-query-bounce` | per device: `id`, `driver`, `stats` (`VirtioDevice::stats`: device counters and the bounce pool's statistics) |
//! | `x-reset-bounce` | resets the bounce pools' high-water marks, lock counters and time histograms (`arguments: {"id": ID}` for one device); returns `{"reset": [ids]}`, or `DeviceNotFound` |
//!
//! Anything else gets `{"error": {"class": "CommandNotFound", "desc": ...}}`; an `id` member
//! is echoed in the reply.
//!
//! **`system_powerdown` is not an ACPI power button.** bouncevm's ACPI tables declare no fixed
//! power button and nothing raises the SCI, so there is no event the guest could see and act on. The command ends the VM from the host side, in order:
//! the vCPUs are stopped, the device workers are stopped (requests complete synchronously, so
//! none is left half done), every disk is flushed to stable storage (`fdatasync`), and the VMM
//! exits with status 0 and a `SHUTDOWN` event. What the guest held in its own page cache is
//! lost, as with pulling the plug after a host-side flush. A guest that should shut down
//! cleanly must be told so another way (e.g. over its console) and then power off or reboot
//! itself (`reboot -f` resets through the i8042, `poweroff` enters ACPI S5 through the PM1a
//! control register; both end the VMM with status 0).

use std::io::{BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use serde_json::{json, Value};

use crate::exit::{ExitHandle, ExitReason};
use crate::virtio_pci::SharedVirtioDevice;

/// A drive as `query-block` reports it.
#[derive(Debug, Clone)]
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
    pub pool: Option<std::sync::Arc<bounce::BouncePool>>,
}

impl std::fmt::Debug for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceInfo")
            .field("id", &self.id)
            .field("driver", &self.driver)
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
}

/// Errors of the monitor socket.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// Binding the socket failed.
    #[error("cannot listen on {path}: {source}")]
    Bind {
        /// Path.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

/// Binds the QMP socket at `path` (a stale socket file is replaced).
///
/// # Errors
/// [`QmpError::Bind`].
pub fn bind(path: &Path) -> Result<UnixListener, QmpError> {
    if std::fs::symlink_metadata(path)
        .map(|m| {
            use std::os::unix::fs::FileTypeExt;
            m.file_type().is_socket()
        })
        .unwrap_or(false)
    {
        let _ = std::fs::remove_file(path);
    }
    UnixListener::bind(path).map_err(|source| QmpError::Bind {
        path: path.display().to_string(),
        source,
    })
}

/// Serves clients one after the other on `listener`, forever (run it on its own thread).
/// `first` is a client already accepted (for `-qmp ...,server` with waiting).
pub fn serve(listener: UnixListener, first: Option<UnixStream>, ctx: QmpContext) {
    if let Some(s) = first {
        handle_client(s, &ctx);
    }
    for stream in listener.incoming() {
        match stream {
            Ok(s) => handle_client(s, &ctx),
            Err(e) => {
                tracing::warn!(error = %e, "QMP accept failed");
                return;
            }
        }
    }
}

fn send(out: &mut UnixStream, v: &Value) -> std::io::Result<()> {
    let mut s = v.to_string();
    s.push_str("\r\n");
    out.write_all(s.as_bytes())
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

fn error(class: &str, desc: String) -> Value {
    json!({"error": {"class": class, "desc": desc}})
}

/// Greeting sent on connect.
pub fn greeting() -> Value {
    let v = env!("CARGO_PKG_VERSION");
    let mut parts = v.split('.').map(|p| p.parse::<u64>().unwrap_or(0));
    json!({"QMP": {
        "version": {
            "qemu": {"major": parts.next(), "minor": parts.next(), "micro": parts.next()},
            "package": "bouncevm",
        },
        "capabilities": [],
    }})
}

fn handle_client(stream: UnixStream, ctx: &QmpContext) {
    let Ok(mut out) = stream.try_clone() else {
        return;
    };
    if send(&mut out, &greeting()).is_err() {
        return;
    }
    let mut negotiated = false;
    let reader = BufReader::new(stream);
    for msg in serde_json::Deserializer::from_reader(reader).into_iter::<Value>() {
        let msg = match msg {
            Ok(m) => m,
            Err(e) if e.is_eof() || e.is_io() => return,
            Err(e) => {
                // The stream cannot be resynchronised after a syntax error: say so and close.
                let _ = send(
                    &mut out,
                    &error("GenericError", format!("JSON parse error: {e}")),
                );
                return;
            }
        };
        let (mut reply, after) = execute(&msg, ctx, &mut negotiated);
        if let (Some(id), Some(obj)) = (msg.get("id"), reply.as_object_mut()) {
            obj.insert("id".into(), id.clone());
        }
        if send(&mut out, &reply).is_err() {
            return;
        }
        match after {
            After::Nothing => {}
            After::PowerDown => {
                let _ = send(&mut out, &event("POWERDOWN", json!({})));
                let _ = send(
                    &mut out,
                    &event(
                        "SHUTDOWN",
                        json!({"guest": false, "reason": "host-qmp-system-powerdown"}),
                    ),
                );
                ctx.exit.request(ExitReason::PowerOff);
            }
            After::Quit => {
                let _ = send(
                    &mut out,
                    &event(
                        "SHUTDOWN",
                        json!({"guest": false, "reason": "host-qmp-quit"}),
                    ),
                );
                ctx.exit.request(ExitReason::Stopped);
            }
        }
    }
}

enum After {
    Nothing,
    PowerDown,
    Quit,
}

fn execute(msg: &Value, ctx: &QmpContext, negotiated: &mut bool) -> (Value, After) {
    let Some(cmd) = msg.get("execute").and_then(Value::as_str) else {
        return (
            error(
                "GenericError",
                "QMP input must be an object with 'execute'".into(),
            ),
            After::Nothing,
        );
    };
    if !*negotiated && cmd != "qmp_capabilities" {
        return (
            error(
                "CommandNotFound",
                "Expecting capabilities negotiation with 'qmp_capabilities'".into(),
            ),
            After::Nothing,
        );
    }
    let ok = |v: Value| json!({ "return": v });
    match cmd {
        "qmp_capabilities" => {
            if *negotiated {
                return (
                    error(
                        "CommandNotFound",
                        "Capabilities negotiation is already complete, command ignored".into(),
                    ),
                    After::Nothing,
                );
            }
            *negotiated = true;
            (ok(json!({})), After::Nothing)
        }
        "query-status" => (
            ok(json!({"status": "running", "running": true, "singlestep": false})),
            After::Nothing,
        ),
        "query-block" => {
            let list: Vec<Value> = ctx
                .blocks
                .iter()
                .map(|b| {
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
                })
                .collect();
            (ok(Value::Array(list)), After::Nothing)
        }
        "x-query-bounce" => {
            let list: Vec<Value> = ctx
                .devices
                .iter()
                .map(|d| {
                    let stats = d.device.lock().map(|g| g.stats()).unwrap_or(Value::Null);
                    json!({"id": d.id, "driver": d.driver, "stats": stats})
                })
                .collect();
            (ok(Value::Array(list)), After::Nothing)
        }
        "x-reset-bounce" => {
            let want = msg
                .get("arguments")
                .and_then(|a| a.get("id"))
                .and_then(Value::as_str);
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
            (ok(json!({ "reset": reset })), After::Nothing)
        }
        "system_powerdown" => (ok(json!({})), After::PowerDown),
        "quit" => (ok(json!({})), After::Quit),
        other => (
            error(
                "CommandNotFound",
                format!("The command {other} has not been found"),
            ),
            After::Nothing,
        ),
    }
}
