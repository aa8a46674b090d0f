//! Commands: the envelope check, the dispatch and each command's reply, as QEMU's QMP gives
//! them (see the module table in [`super`]).

use serde_json::{json, Map, Value};

use super::{BlockInfo, DeviceInfo, QmpContext};
use crate::vcpu::state::{query, QUERY_TIMEOUT};

/// A QMP error reply of `class`.
pub(super) fn error(class: &str, desc: impl Into<String>) -> Value {
    json!({"error": {"class": class, "desc": desc.into()}})
}

/// A `GenericError` reply.
pub(super) fn generic(desc: impl Into<String>) -> Value {
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

/// What the session does after sending a reply.
pub(super) enum After {
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
    "x-query-vcpus",
    "human-monitor-command",
];

/// The arguments `cmd` takes (all optional here).
fn arguments_of(cmd: &str) -> &'static [&'static str] {
    match cmd {
        "qmp_capabilities" => &["enable"],
        // QEMU's query-blockstats takes `query-nodes`; bouncevm reports devices only.
        "query-blockstats" => &["query-nodes"],
        "x-reset-bounce" => &["id"],
        "human-monitor-command" => &["command-line", "cpu-index"],
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

/// Checks and runs one command; the reply (without the `id`) and what follows it.
pub(super) fn execute(msg: &Value, ctx: &QmpContext, negotiated: &mut bool) -> (Value, After) {
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
            .vcpus
            .iter()
            .enumerate()
            .map(|(i, v)| {
                json!({
                    "cpu-index": i,
                    "qom-path": format!("/machine/unattached/device[{i}]"),
                    "thread-id": v.thread_id(),
                    "props": {"socket-id": 0, "core-id": i, "thread-id": 0},
                    "target": "x86_64",
                })
            })
            .collect()),
        "query-block" => ok(ctx.blocks.iter().map(block_info).collect()),
        "query-blockstats" => ok(ctx.blocks.iter().map(block_stats).collect()),
        "x-query-bounce" => ok(bounce_report(&ctx.devices, &ctx.pools)),
        "x-reset-bounce" => reset_bounce(&args, ctx),
        "x-query-vcpus" => ok(query(&ctx.vcpus, QUERY_TIMEOUT).into()),
        "human-monitor-command" => (
            super::hmp::human_monitor_command(&args, ctx),
            After::Nothing,
        ),
        "system_powerdown" => (json!({"return": {}}), After::PowerDown),
        "quit" | "x-exit-now" => (json!({"return": {}}), After::Quit),
        _ => unreachable!("every name in COMMANDS is handled"),
    }
}

/// The devices' statistics, then the shared pools' (`x-query-bounce`).
fn bounce_report(devices: &[DeviceInfo], pools: &devices::pools::PoolRegistry) -> Value {
    let mut list: Vec<Value> = device_stats(devices);
    if let Value::Array(p) = pools.pools_json() {
        list.extend(p);
    }
    Value::Array(list)
}

/// Each device's `{"id", "driver", "stats"}`.
pub fn device_stats(devices: &[DeviceInfo]) -> Vec<Value> {
    devices
        .iter()
        .map(|d| {
            let stats = d.device.lock().map(|g| g.stats()).unwrap_or(Value::Null);
            json!({"id": d.id, "driver": d.driver, "stats": stats})
        })
        .collect()
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
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::exit::ExitHandle;
    use crate::virtio_pci::SharedVirtioDevice;

    /// A read-only block device on `img` with the bounce options `bounce`, its DMA from
    /// `pools`.
    fn device_on(
        img: &std::path::Path,
        bounce: &str,
        pools: &mut devices::pools::PoolRegistry,
        id: &str,
    ) -> (SharedVirtioDevice, Option<Arc<bounce::BouncePool>>) {
        let b = devices::builder::block(
            img,
            Some(devices::block::io::ImageFormat::Raw),
            true,
            devices::block::BlockConfig::default(),
            &bounce.parse().unwrap(),
            pools,
            id,
        )
        .unwrap();
        let device: SharedVirtioDevice = Arc::new(Mutex::new(b.device));
        (device, b.pool)
    }

    /// `x-query-bounce` lists each device with its own counters, and a shared pool once, after
    /// the devices, with the devices that use it.
    #[test]
    fn x_query_bounce_lists_a_shared_pool_once() {
        let img = std::env::temp_dir().join(format!("bvm-qmp-pools-{}.img", std::process::id()));
        std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
        let mut pools = devices::pools::PoolRegistry::default();
        let mut c = ctx();
        for (id, bounce) in [
            ("blk0", "pool=shared,slots=256"),
            ("blk1", "pool=shared,slots=256,policy=mask=32"),
            ("blk2", "slots=128"),
        ] {
            let (device, pool) = device_on(&img, bounce, &mut pools, id);
            c.devices.push(DeviceInfo {
                id: id.into(),
                driver: "virtio-blk-pci".into(),
                device,
                pool,
            });
        }
        c.pools = Arc::new(pools);
        let _ = std::fs::remove_file(&img);
        let mut neg = true;
        let r = execute(&json!({"execute": "x-query-bounce"}), &c, &mut neg).0;
        let list = r["return"].as_array().unwrap();
        assert_eq!(list.len(), 4, "{r}");
        assert_eq!(list[0]["stats"]["bounce"], json!({"pool": "shared"}));
        assert_eq!(list[1]["stats"]["dma"]["pool"], "shared");
        assert_eq!(list[1]["stats"]["policy"], "mask=32");
        assert_eq!(list[2]["stats"]["bounce"]["nslabs"], 128);
        assert_eq!(list[2]["stats"]["dma"]["maps"], 0);
        assert_eq!(list[3]["pool"], "shared");
        assert_eq!(list[3]["devices"], json!(["blk0", "blk1"]));
        assert_eq!(list[3]["stats"]["nslabs"], 256);
        assert!(list[..3].iter().all(|d| d.get("pool").is_none()));
    }

    fn ctx() -> QmpContext {
        QmpContext {
            exit: ExitHandle::new().unwrap(),
            blocks: Vec::new(),
            devices: Vec::new(),
            name: Some("vm1".into()),
            vcpus: Arc::from(vec![crate::vcpu::VcpuShared::new(0)]),
            power_button: None,
            pools: Arc::default(),
        }
    }

    /// `x-reset-bounce` clears the high-water mark of the named pool (or all), answers the ids
    /// reset, and refuses an unknown id or a non-string one.
    #[test]
    fn x_reset_bounce_resets_the_pools_high_water_marks() {
        use bounce::{Direction, HostMemory, MapRequest};
        let img = std::env::temp_dir().join(format!("bvm-qmp-reset-{}.img", std::process::id()));
        std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
        let mut pools = devices::pools::PoolRegistry::default();
        let (d0, p0) = device_on(&img, "policy=force,slots=256", &mut pools, "blk0");
        let (d1, p1) = device_on(&img, "policy=off", &mut pools, "blk1");
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
        // The vCPU thread has not run: no thread id yet.
        assert_eq!(
            ex(json!({"execute": "query-cpus-fast"}))["return"][0]["thread-id"],
            0
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
}
