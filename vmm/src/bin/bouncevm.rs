//! `bouncevm`: boots a Linux kernel on KVM with virtio-pci devices whose DMA goes through the
//! bounce module. QEMU-compatible command line; see `vmm/README.md`.
//!
//! SIGTERM and SIGINT end the VM as QMP `quit` does, as in QEMU: the vCPUs and device
//! workers stop, the devices' final statistics are printed to stderr as one JSON line
//! (`{"devices": [{"id", "driver", "stats"}], "pools": [{"pool", "devices", "stats"}],
//! "vcpus": [{"id", "pio_exits", "mmio_exits", "pio_unhandled", "mmio_unhandled",
//! "interrupted"}]}`: the devices and the shared bounce pools as `x-query-bounce` answers
//! them and as `bouncevm-vhost` prints its own, the vCPUs' exits to the VMM; on every
//! exit, not only a signal), every disk is flushed, the terminal is restored, a `SHUTDOWN`
//! event with cause `host-signal` goes to the QMP client, and the exit status is 0.

use std::io::{IsTerminal, Read, Write};
use std::path::Path;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use bouncevm_common::sock::BoundSocket;
use bouncevm_common::SignalFd;
use devices::block::{BlockConfig, Disk, DiskImage};
use devices::builder;
use devices::net::NetConfig;
use devices::pools::PoolRegistry;
use vmm::boot::linux::LinuxBootConfig;
use vmm::cli::{self, Action, BlkSpec, Config, DeviceSpec, NetSpec};
use vmm::exit::{ExitHandle, ExitReason};
use vmm::legacy::SerialConsole;
use vmm::machine::MachineExit;
use vmm::qmp::{self, BlockInfo, DeviceInfo, Monitor, QmpContext, ShutdownCause};
use vmm::vcpu::VcpuStats;
use vmm::virtio_pci::{SharedVirtioDevice, VirtioPciDevice, VirtioPciOptions};
use vmm::{Machine, MachineConfig};

/// Restores the terminal on drop.
struct RawTerminal(Option<libc::termios>);

impl RawTerminal {
    fn enable() -> Self {
        if !std::io::stdin().is_terminal() {
            return RawTerminal(None);
        }
        // SAFETY: termios is plain data; tcgetattr fills it for fd 0 and we check the result.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: fd 0 is open; `t` is a valid termios to fill.
        if unsafe { libc::tcgetattr(0, &mut t) } != 0 {
            return RawTerminal(None);
        }
        let saved = t;
        // SAFETY: `t` is a valid termios obtained above.
        unsafe { libc::cfmakeraw(&mut t) };
        // Keep output post-processing so guest "\n" still renders as usual.
        t.c_oflag |= libc::OPOST;
        // SAFETY: fd 0 is a terminal; `t` is a valid termios.
        unsafe { libc::tcsetattr(0, libc::TCSANOW, &t) };
        RawTerminal(Some(saved))
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        if let Some(t) = self.0 {
            // SAFETY: restores the attributes read by tcgetattr on the same fd.
            unsafe { libc::tcsetattr(0, libc::TCSANOW, &t) };
        }
    }
}

fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("bouncevm: {msg}");
    ExitCode::from(1)
}

fn check_readable(what: &str, p: &Path) -> Result<(), String> {
    std::fs::File::open(p)
        .map(|_| ())
        .map_err(|e| format!("cannot open {what} '{}': {e}", p.display()))
}

/// Everything the devices left for the exit path and the monitor.
#[derive(Default)]
struct Built {
    functions: Vec<Arc<Mutex<VirtioPciDevice>>>,
    disks: Vec<Arc<DiskImage>>,
    qmp_devices: Vec<DeviceInfo>,
    qmp_blocks: Vec<BlockInfo>,
    /// The shared bounce pools.
    pools: Arc<PoolRegistry>,
}

/// A device core and its bounce pool (none when it does not bounce).
type BuiltDevice = (SharedVirtioDevice, Option<Arc<bounce::BouncePool>>);

fn build_blk(
    cfg: &Config,
    b: &BlkSpec,
    built: &mut Built,
    pools: &mut PoolRegistry,
) -> Result<BuiltDevice, String> {
    let id = &b.common.id;
    let d = cfg
        .drive(&b.drive)
        .ok_or_else(|| format!("drive '{}' is not defined", b.drive))?;
    let config = BlockConfig {
        serial: b.serial.clone(),
        num_queues: b.num_queues,
        queue_size: b.queue_size,
        blk_size: b.logical_block_size,
        access_platform: b.common.iommu_platform,
        aio: d.aio,
        cache: d.cache,
        ..BlockConfig::default()
    };
    let drive_err = |e: builder::BuildError| format!("-drive id={}: {e}", d.id);
    let format = builder::probe_format(&d.file, d.format).map_err(drive_err)?;
    let b = builder::block(
        &d.file,
        Some(format),
        d.readonly,
        config,
        &cfg.bounce_for(id),
        pools,
        id,
    )
    .map_err(drive_err)?;
    let (blk, pool) = (b.device, b.pool);
    built.disks.push(blk.disk().clone());
    let device: SharedVirtioDevice = Arc::new(Mutex::new(blk));
    built.qmp_blocks.push(BlockInfo {
        id: d.id.clone(),
        qdev: id.clone(),
        file: d.file.display().to_string(),
        format: format!("{format:?}").to_lowercase(),
        readonly: d.readonly,
        device: Some(device.clone()),
    });
    Ok((device, pool))
}

fn build_net(cfg: &Config, n: &NetSpec, pools: &mut PoolRegistry) -> Result<BuiltDevice, String> {
    let nd = cfg
        .netdev(&n.netdev)
        .ok_or_else(|| format!("netdev '{}' is not defined", n.netdev))?;
    let config = NetConfig {
        queue_pairs: if n.mq { nd.queues } else { 1 },
        access_platform: n.common.iommu_platform,
        mac: n.mac.unwrap_or(cli::DEFAULT_MAC),
        ..NetConfig::default()
    };
    let id = &n.common.id;
    let (net, tap) = builder::net(nd.ifname.as_deref(), config, &cfg.bounce_for(id), pools, id)
        .map_err(|e| format!("-netdev id={}: {e}", nd.id))?;
    tracing::info!(netdev = %nd.id, tap, "tap opened");
    Ok((Arc::new(Mutex::new(net.device)), net.pool))
}

fn build_devices(m: &mut Machine, cfg: &Config) -> Result<Built, String> {
    let pci = m.add_pci().map_err(|e| format!("PCI: {e}"))?;
    let mut built = Built::default();
    let mut pools = PoolRegistry::default();
    for spec in &cfg.devices {
        let id = spec.id().to_string();
        let driver = spec.driver();
        let (device, pool) = match spec {
            DeviceSpec::Blk(b) => build_blk(cfg, b, &mut built, &mut pools)?,
            DeviceSpec::Net(n) => build_net(cfg, n, &mut pools)?,
        };
        let what = |e: &dyn std::fmt::Display| format!("-device {driver},id={id}: {e}");
        let f = VirtioPciDevice::new(
            &id,
            device.clone(),
            m.vm().clone(),
            &pci,
            VirtioPciOptions::default(),
        )
        .map_err(|e| what(&e))?;
        let f = Arc::new(Mutex::new(f));
        pci.add_device(f.clone()).map_err(|e| what(&e))?;
        built.functions.push(f);
        built.qmp_devices.push(DeviceInfo {
            id,
            driver: driver.into(),
            device,
            pool,
        });
    }
    built.pools = Arc::new(pools);
    Ok(built)
}

type Serial = Arc<Mutex<SerialConsole<std::io::Stdout>>>;

/// The machine with its legacy devices, ACPI, virtio devices and the kernel loaded.
fn build_machine(cfg: &Config) -> Result<(Machine, Serial, Built), String> {
    check_readable("kernel", &cfg.kernel)?;
    if let Some(i) = &cfg.initrd {
        check_readable("initrd", i)?;
    }
    for d in &cfg.drives {
        check_readable(&format!("drive '{}'", d.id), &d.file)?;
        builder::probe_format(&d.file, d.format).map_err(|e| format!("-drive id={}: {e}", d.id))?;
    }
    let mut m = Machine::new(&MachineConfig {
        mem_size: cfg.mem_size,
        vcpus: cfg.smp,
    })
    .map_err(|e| format!("cannot create the VM: {e}"))?;
    let serial = m
        .add_serial(std::io::stdout())
        .map_err(|e| format!("serial: {e}"))?;
    m.add_i8042().map_err(|e| format!("i8042: {e}"))?;
    if !cfg.no_acpi {
        m.add_acpi().map_err(|e| format!("ACPI: {e}"))?;
    }
    let built = build_devices(&mut m, cfg)?;
    m.load_linux(&LinuxBootConfig {
        kernel: cfg.kernel.clone(),
        initrd: cfg.initrd.clone(),
        cmdline: cfg.append.clone(),
        prefer_pvh: true,
    })
    .map_err(|e| format!("cannot load kernel '{}': {e}", cfg.kernel.display()))?;
    Ok((m, serial, built))
}

/// Binds `-qmp`, waits for the first client when asked, and starts the monitor thread.
/// `Ok(None)` without `-qmp`, or when a signal ended the wait (the exit is then requested).
fn start_qmp(
    cfg: &Config,
    m: &Machine,
    built: &Built,
    monitor: &Arc<Monitor>,
) -> Result<Option<BoundSocket>, String> {
    let Some(q) = &cfg.qmp else {
        return Ok(None);
    };
    let exit = m.exit_handle();
    let sock = qmp::bind(&q.path, cfg.socket_mode).map_err(|e| format!("-qmp: {e}"))?;
    let mut first = None;
    if q.wait {
        eprintln!("bouncevm: waiting for a QMP client on {}", q.path.display());
        first = qmp::wait_for_client(&sock.listener, exit).map_err(|e| format!("-qmp: {e}"))?;
        if first.is_none() {
            sock.remove();
            return Ok(None);
        }
    }
    let ctx = QmpContext {
        exit: exit.clone(),
        blocks: built.qmp_blocks.clone(),
        devices: built.qmp_devices.clone(),
        pools: built.pools.clone(),
        name: cfg.name.clone(),
        vcpus: m.vcpu_shared(),
        power_button: m.power_button().cloned(),
    };
    let listener = sock
        .listener
        .try_clone()
        .map_err(|e| format!("-qmp: {e}"))?;
    let monitor = monitor.clone();
    std::thread::Builder::new()
        .name("qmp".into())
        .spawn(move || qmp::serve(listener, first, ctx, monitor))
        .map_err(|e| format!("-qmp: {e}"))?;
    Ok(Some(sock))
}

/// Forwards stdin to the UART; `Ctrl-A x` quits as in QEMU (the thread blocks in read() and
/// is left behind when the VMM exits).
fn spawn_stdin(serial: Serial, exit: ExitHandle, monitor: Arc<Monitor>, tty: bool) {
    let _ = std::thread::Builder::new()
        .name("stdin".into())
        .spawn(move || {
            let mut stdin = std::io::stdin();
            let mut buf = [0u8; 64];
            let mut ctrl_a = false;
            loop {
                let n = match stdin.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                for &c in &buf[..n] {
                    // Ctrl-A x quits, Ctrl-A Ctrl-A sends Ctrl-A.
                    if tty && ctrl_a {
                        ctrl_a = false;
                        if c == b'x' {
                            monitor.stop(&exit, ShutdownCause::HostUi);
                            return;
                        }
                        if c != 1 {
                            continue;
                        }
                    } else if tty && c == 1 {
                        ctrl_a = true;
                        continue;
                    }
                    let mut s = serial.lock().unwrap_or_else(|e| e.into_inner());
                    let _ = s.enqueue_input(&[c]);
                }
            }
        });
}

/// Turns SIGTERM/SIGINT into a host-signal stop.
fn spawn_signal_thread(signals: SignalFd, exit: ExitHandle, monitor: Arc<Monitor>) {
    use std::os::fd::AsRawFd;
    let _ = std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || loop {
            let mut pfd = libc::pollfd {
                fd: signals.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: `pfd` is a valid pollfd for the duration of the call.
            if unsafe { libc::poll(&mut pfd, 1, -1) } < 0 {
                continue;
            }
            while let Some(sig) = signals.read() {
                tracing::info!(signal = sig, "terminating on signal");
                monitor.stop(&exit, ShutdownCause::HostSignal);
            }
        });
}

/// Stops the device workers, prints the devices' and vCPUs' final statistics and flushes
/// every disk.
fn quiesce(built: &Built, vcpus: &[VcpuStats]) {
    for f in &built.functions {
        f.lock().unwrap_or_else(|e| e.into_inner()).stop_workers();
    }
    eprintln!("{}", final_stats(built, vcpus));
    for d in &built.disks {
        if let Err(e) = d.flush() {
            eprintln!("bouncevm: flushing a disk failed: {e}");
        }
    }
    let _ = std::io::stdout().flush();
}

/// The devices' statistics (as `x-query-bounce` answers them, and as `bouncevm-vhost` prints
/// its own on exit) and the vCPUs' exit counters, as one JSON line (see the module
/// documentation).
fn final_stats(built: &Built, vcpus: &[VcpuStats]) -> serde_json::Value {
    let list = vmm::qmp::device_stats(&built.qmp_devices);
    let vcpus: Vec<serde_json::Value> = vcpus
        .iter()
        .enumerate()
        .map(|(id, v)| {
            serde_json::json!({"id": id, "pio_exits": v.pio_exits, "mmio_exits": v.mmio_exits,
                "pio_unhandled": v.pio_unhandled, "mmio_unhandled": v.mmio_unhandled,
                "interrupted": v.interrupted})
        })
        .collect();
    serde_json::json!({ "devices": list, "pools": built.pools.pools_json(), "vcpus": vcpus })
}

fn report(cfg: &Config, exit: &MachineExit) -> i32 {
    match &exit.reason {
        ExitReason::Reset | ExitReason::TripleFault if !cfg.no_reboot => {
            eprintln!(
                "bouncevm: guest reset; rebooting is not supported, exiting as with -no-reboot"
            );
        }
        ExitReason::Error(e) => eprintln!("bouncevm: {e}"),
        ExitReason::GuestCrash => eprintln!("bouncevm: guest crashed"),
        _ => {}
    }
    exit.reason.exit_code()
}

fn run(cfg: Config, signals: SignalFd) -> Result<i32, String> {
    let monitor = Monitor::new();
    let (m, serial, built) = build_machine(&cfg)?;
    let exit = m.exit_handle().clone();
    // Signals are handled from here on (also while waiting for a QMP client).
    spawn_signal_thread(signals, exit.clone(), monitor.clone());
    let qmp_sock = start_qmp(&cfg, &m, &built, &monitor)?;
    if exit.is_requested() {
        // A signal while waiting for the QMP client: nothing ran yet.
        return Ok(0);
    }
    let raw = RawTerminal::enable();
    spawn_stdin(serial, exit, monitor.clone(), raw.0.is_some());

    let result = m
        .start()
        .map_err(|e| format!("cannot start vCPUs: {e}"))?
        .wait();
    quiesce(
        &built,
        result.as_ref().map_or(&[], |e| e.vcpu_stats.as_slice()),
    );
    drop(raw);
    if let Ok(e) = &result {
        monitor.shutdown_event(&e.reason);
    }
    monitor.close();
    if let Some(s) = &qmp_sock {
        s.remove();
    }
    let exit = result.map_err(|e| format!("VM: {e}"))?;
    Ok(report(&cfg, &exit))
}

fn main() -> ExitCode {
    // Block the signals before any thread exists, so only the signalfd sees them.
    let signals = match SignalFd::new(&[libc::SIGINT, libc::SIGTERM]) {
        Ok(s) => s,
        Err(e) => return fail(format!("cannot set up signal handling: {e}")),
    };
    bouncevm_common::init_logging("warn");
    let cfg = match cli::parse_action(std::env::args().skip(1)) {
        Ok(Action::Run(c)) => *c,
        Ok(Action::Help) => {
            print!("{}", cli::USAGE);
            return ExitCode::SUCCESS;
        }
        Ok(Action::Version) => {
            println!("{}", cli::version_line());
            return ExitCode::SUCCESS;
        }
        Err(e) => return fail(e),
    };
    match run(cfg, signals) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => fail(e),
    }
}
