//! `bouncevm`: boots a Linux kernel on KVM with virtio-pci devices whose DMA goes through the
//! bounce module. QEMU-compatible command line; see `vmm/README.md`.

use std::io::{IsTerminal, Read, Write};
use std::path::Path;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use devices::block::{Block, BlockConfig, Disk, DiskImage};
use devices::net::{Net, NetConfig};
use vmm::boot::linux::LinuxBootConfig;
use vmm::cli::{self, Config, DeviceSpec};
use vmm::exit::ExitReason;
use vmm::qmp::{self, BlockInfo, DeviceInfo, QmpContext};
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

struct Built {
    functions: Vec<Arc<Mutex<VirtioPciDevice>>>,
    disks: Vec<Arc<DiskImage>>,
    qmp_devices: Vec<DeviceInfo>,
    qmp_blocks: Vec<BlockInfo>,
}

fn build_devices(m: &mut Machine, cfg: &Config) -> Result<Built, String> {
    let pci = m.add_pci().map_err(|e| format!("PCI: {e}"))?;
    let mut b = Built {
        functions: Vec::new(),
        disks: Vec::new(),
        qmp_devices: Vec::new(),
        qmp_blocks: Vec::new(),
    };
    for spec in &cfg.devices {
        let id = spec.id().to_string();
        let bounce = cfg.bounce_for(&id);
        let (device, driver, pool): (SharedVirtioDevice, &str, _) = match spec {
            DeviceSpec::Blk {
                drive,
                num_queues,
                serial,
                iommu_platform,
                ..
            } => {
                let d = cfg
                    .drive(drive)
                    .ok_or_else(|| format!("drive '{drive}' is not defined"))?;
                let (dma, p) = bounce
                    .build(usize::from(*num_queues))
                    .map_err(|e| format!("-bounce for {id}: {e}"))?;
                let image = DiskImage::open(&d.file, d.format, d.readonly).map_err(|e| {
                    format!(
                        "-drive id={}: cannot open '{}': {e}",
                        d.id,
                        d.file.display()
                    )
                })?;
                let mut bc = BlockConfig {
                    readonly: d.readonly,
                    num_queues: *num_queues,
                    access_platform: *iommu_platform,
                    ..BlockConfig::default()
                };
                if let Some(s) = serial {
                    bc.serial = s.clone();
                }
                let blk = Block::new(image, bc, dma).map_err(|e| format!("-device {id}: {e}"))?;
                b.disks.push(blk.disk().clone());
                b.qmp_blocks.push(BlockInfo {
                    id: d.id.clone(),
                    qdev: id.clone(),
                    file: d.file.display().to_string(),
                    format: format!("{:?}", d.format).to_lowercase(),
                    readonly: d.readonly,
                });
                (Arc::new(Mutex::new(blk)), "virtio-blk-pci", p)
            }
            DeviceSpec::Net {
                netdev,
                mac,
                mq,
                iommu_platform,
                ..
            } => {
                let n = cfg
                    .netdev(netdev)
                    .ok_or_else(|| format!("netdev '{netdev}' is not defined"))?;
                let pairs = if *mq { n.queues } else { 1 };
                let (dma, p) = bounce
                    .build(usize::from(pairs))
                    .map_err(|e| format!("-bounce for {id}: {e}"))?;
                let mut nc = NetConfig {
                    queue_pairs: pairs,
                    access_platform: *iommu_platform,
                    ..NetConfig::default()
                };
                if let Some(mac) = mac {
                    nc.mac = *mac;
                }
                let net = Net::with_tap(nc, &n.ifname, dma)
                    .map_err(|e| format!("-netdev id={}: tap '{}': {e}", n.id, n.ifname))?;
                (Arc::new(Mutex::new(net)), "virtio-net-pci", p)
            }
        };
        let f = VirtioPciDevice::new(
            &id,
            device.clone(),
            m.vm().clone(),
            &pci,
            VirtioPciOptions::default(),
        )
        .map_err(|e| format!("-device {driver},id={id}: {e}"))?;
        let f = Arc::new(Mutex::new(f));
        pci.add_device(f.clone())
            .map_err(|e| format!("-device {driver},id={id}: {e}"))?;
        b.functions.push(f);
        b.qmp_devices.push(DeviceInfo {
            id,
            driver: driver.into(),
            device,
            pool,
        });
    }
    Ok(b)
}

fn run(cfg: Config) -> Result<i32, String> {
    check_readable("kernel", &cfg.kernel)?;
    if let Some(i) = &cfg.initrd {
        check_readable("initrd", i)?;
    }
    for d in &cfg.drives {
        check_readable(&format!("drive '{}'", d.id), &d.file)?;
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
    let built = build_devices(&mut m, &cfg)?;
    m.load_linux(&LinuxBootConfig {
        kernel: cfg.kernel.clone(),
        initrd: cfg.initrd.clone(),
        cmdline: cfg.append.clone(),
        prefer_pvh: true,
    })
    .map_err(|e| format!("cannot load kernel '{}': {e}", cfg.kernel.display()))?;

    let exit = m.exit_handle().clone();
    let mut qmp_listener = None;
    let mut first_client = None;
    if let Some(q) = &cfg.qmp {
        let l = qmp::bind(&q.path).map_err(|e| format!("-qmp: {e}"))?;
        if q.wait {
            eprintln!("bouncevm: waiting for a QMP client on {}", q.path.display());
            first_client = Some(l.accept().map_err(|e| format!("-qmp: {e}"))?.0);
        }
        qmp_listener = Some(l);
    }
    if let Some(l) = qmp_listener {
        let ctx = QmpContext {
            exit: exit.clone(),
            blocks: built.qmp_blocks.clone(),
            devices: built.qmp_devices.clone(),
        };
        std::thread::Builder::new()
            .name("qmp".into())
            .spawn(move || qmp::serve(l, first_client, ctx))
            .map_err(|e| format!("-qmp: {e}"))?;
    }

    let raw = RawTerminal::enable();
    let tty = raw.0.is_some();
    let input_exit = exit.clone();
    let input_serial = serial.clone();
    // The input thread blocks in read(); it is left behind when the VMM exits.
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
                    // QEMU's escape: Ctrl-A x quits, Ctrl-A Ctrl-A sends Ctrl-A.
                    if tty && ctrl_a {
                        ctrl_a = false;
                        if c == b'x' {
                            input_exit.request(ExitReason::Stopped);
                            return;
                        }
                        if c != 1 {
                            continue;
                        }
                    } else if tty && c == 1 {
                        ctrl_a = true;
                        continue;
                    }
                    let mut s = input_serial.lock().unwrap_or_else(|e| e.into_inner());
                    let _ = s.enqueue_input(&[c]);
                }
            }
        });

    let running = m.start().map_err(|e| format!("cannot start vCPUs: {e}"))?;
    let result = running.wait();
    for f in &built.functions {
        f.lock().unwrap_or_else(|e| e.into_inner()).stop_workers();
    }
    // Final statistics on stderr as one JSON line, as bouncevm-vhost prints them.
    let final_stats: Vec<serde_json::Value> = built
        .qmp_devices
        .iter()
        .map(|d| {
            let stats = d
                .device
                .lock()
                .map(|g| g.stats())
                .unwrap_or(serde_json::Value::Null);
            serde_json::json!({"id": d.id, "driver": d.driver, "stats": stats})
        })
        .collect();
    eprintln!("{}", serde_json::json!({ "devices": final_stats }));
    for d in &built.disks {
        if let Err(e) = d.flush() {
            eprintln!("bouncevm: flushing a disk failed: {e}");
        }
    }
    let _ = std::io::stdout().flush();
    drop(raw);
    if let Some(q) = &cfg.qmp {
        let _ = std::fs::remove_file(&q.path);
    }
    let exit = result.map_err(|e| format!("VM: {e}"))?;
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
    Ok(exit.reason.exit_code())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BOUNCEVM_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cfg = match cli::parse(std::env::args().skip(1)) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    match run(cfg) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => fail(e),
    }
}
