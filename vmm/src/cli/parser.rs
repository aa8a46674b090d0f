//! The parser: one function per flag (the [`FLAGS`] table), and a last pass that
//! cross-checks references and fills in per-device defaults.

use std::path::PathBuf;

use devices::options::BounceOptions;

use super::props::{
    apply, device_props, parse_size, put, require, split_props, Prop, Smp, BLK_COMMON, BLK_PROPS,
    DRIVE_PROPS, NET_COMMON, NET_PROPS, SMP_PROPS, TAP_PROPS,
};
use super::spec::{
    BlkSpec, Config, DeviceSpec, DriveSpec, NetSpec, NetdevSpec, PciCommon, QmpSpec,
};
use super::{CliError, Result, DEFAULT_MAC, MAX_VCPUS};

/// The command line while it is being read.
#[derive(Debug)]
pub(super) struct Parser {
    cfg: Config,
    kernel: Option<PathBuf>,
    nics: usize,
}

/// One flag: its spellings, whether it takes an argument, and its parser.
pub(super) struct Flag {
    pub names: &'static [&'static str],
    pub arg: bool,
    pub parse: fn(&mut Parser, &str, &str) -> Result<()>,
}

/// Every flag bouncevm accepts (`-h`/`--help`/`-version` are handled before this table).
pub(super) const FLAGS: &[Flag] = &[
    Flag {
        names: &["-m"],
        arg: true,
        parse: Parser::mem,
    },
    Flag {
        names: &["-smp"],
        arg: true,
        parse: Parser::smp,
    },
    Flag {
        names: &["-kernel"],
        arg: true,
        parse: |p, _, a| put(&mut p.kernel, Some(a.into())),
    },
    Flag {
        names: &["-initrd"],
        arg: true,
        parse: |p, _, a| put(&mut p.cfg.initrd, Some(a.into())),
    },
    Flag {
        names: &["-append"],
        arg: true,
        parse: |p, _, a| put(&mut p.cfg.append, a.into()),
    },
    Flag {
        names: &["-drive"],
        arg: true,
        parse: Parser::drive,
    },
    Flag {
        names: &["-netdev"],
        arg: true,
        parse: Parser::netdev,
    },
    Flag {
        names: &["-nic"],
        arg: true,
        parse: Parser::nic,
    },
    Flag {
        names: &["-device"],
        arg: true,
        parse: Parser::device,
    },
    Flag {
        names: &["-serial"],
        arg: true,
        parse: Parser::serial,
    },
    Flag {
        names: &["-qmp"],
        arg: true,
        parse: Parser::qmp,
    },
    Flag {
        names: &["-bounce"],
        arg: true,
        parse: Parser::bounce,
    },
    Flag {
        names: &["-socket-mode"],
        arg: true,
        parse: |p, f, a| {
            put(
                &mut p.cfg.socket_mode,
                bouncevm_common::sock::parse_mode(a).map_err(|e| bad_flag(f, a, &e))?,
            )
        },
    },
    Flag {
        names: &["-machine", "-M"],
        arg: true,
        parse: Parser::machine,
    },
    Flag {
        names: &["-accel"],
        arg: true,
        parse: Parser::accel,
    },
    Flag {
        names: &["-cpu"],
        arg: true,
        parse: Parser::cpu,
    },
    Flag {
        names: &["-name"],
        arg: true,
        parse: Parser::name,
    },
    Flag {
        names: &["-display", "-vga", "-monitor"],
        arg: true,
        parse: Parser::none_only,
    },
    Flag {
        names: &["-nographic", "-nodefaults", "-enable-kvm"],
        arg: false,
        parse: |_, _, _| Ok(()),
    },
    Flag {
        names: &["-no-reboot"],
        arg: false,
        parse: |p, _, _| put(&mut p.cfg.no_reboot, true),
    },
    Flag {
        names: &["-no-acpi"],
        arg: false,
        parse: |p, _, _| put(&mut p.cfg.no_acpi, true),
    },
];

/// The back ends of one kind (`-drive` or `-netdev`) that devices name by id: each one a
/// device names must be defined, and no two devices may name the same one.
struct Backends<'a> {
    kind: &'static str,
    defined: Vec<&'a str>,
    used: std::collections::HashSet<String>,
}

impl<'a> Backends<'a> {
    fn new(kind: &'static str, defined: impl Iterator<Item = &'a str>) -> Self {
        Backends {
            kind,
            defined: defined.collect(),
            used: std::collections::HashSet::new(),
        }
    }

    /// Records that `-device device` uses the back end `id`.
    fn claim(&mut self, device: &str, id: &str) -> Result<()> {
        let kind = self.kind;
        if !self.defined.contains(&id) {
            return Err(CliError::Reference(format!(
                "-device {device}: {kind} '{id}' is not defined by a -{kind}"
            )));
        }
        if !self.used.insert(id.to_string()) {
            return Err(CliError::Reference(format!(
                "{kind} '{id}' is used by more than one device"
            )));
        }
        Ok(())
    }
}

fn bad_flag(flag: &str, value: &str, reason: &str) -> CliError {
    CliError::BadValue {
        what: flag.into(),
        value: value.into(),
        reason: reason.into(),
    }
}

/// Splits `[key=]value,k=v,...` into property items; a bare first item is the value of `key`.
fn props_with_implied_key(arg: &str, key: &str) -> Vec<String> {
    let mut items = split_props(arg);
    if items
        .first()
        .is_some_and(|i| !i.contains('=') && !i.is_empty())
    {
        items[0] = format!("{key}={}", items[0]);
    }
    items
}

/// `kernel-irqchip=on` of `-machine` and `-accel kvm`.
const KERNEL_IRQCHIP: Prop<()> = Prop {
    name: "kernel-irqchip",
    set: |_, v| v.only_bool(true, "the irqchip is always in the kernel"),
};

/// Splits `first,k=v,...` into the leading name and the property items.
fn head_and_props(arg: &str) -> (String, Vec<String>) {
    let mut items = split_props(arg);
    let head = items.remove(0);
    (head, items)
}

impl Parser {
    /// An empty command line: QEMU's defaults.
    pub(super) fn new() -> Self {
        Parser {
            cfg: Config {
                mem_size: 512 << 20,
                smp: 1,
                kernel: PathBuf::new(),
                initrd: None,
                append: String::new(),
                name: None,
                drives: Vec::new(),
                netdevs: Vec::new(),
                devices: Vec::new(),
                no_reboot: false,
                no_acpi: false,
                qmp: None,
                bounce_default: None,
                bounce: Vec::new(),
                socket_mode: bouncevm_common::sock::DEFAULT_SOCKET_MODE,
            },
            kernel: None,
            nics: 0,
        }
    }

    fn mem(&mut self, flag: &str, arg: &str) -> Result<()> {
        let (size, props) = head_and_props(arg);
        if let Some(p) = props.iter().find(|p| !p.is_empty()) {
            let key = p.split_once('=').map_or(p.as_str(), |(k, _)| k);
            return Err(CliError::UnsupportedProperty {
                prop: key.into(),
                opt: flag.into(),
            });
        }
        self.cfg.mem_size = parse_size(&size)
            .filter(|&s| s >= 16 << 20 && s % 4096 == 0)
            .ok_or_else(|| {
                bad_flag(
                    flag,
                    arg,
                    "expected SIZE[K|M|G|T] of at least 16M, a multiple of 4K",
                )
            })?;
        Ok(())
    }

    /// `-smp [cpus=]N[,sockets=,dies=,cores=,threads=,maxcpus=]`: bouncevm's topology is one
    /// socket of N single-threaded cores (see `boot::cpuid`), so only that shape is accepted.
    fn smp(&mut self, flag: &str, arg: &str) -> Result<()> {
        let items = props_with_implied_key(arg, "cpus");
        let mut s = Smp::default();
        apply(flag, &items, SMP_PROPS, &mut s)?;
        let cpus = match (s.cpus, s.cores) {
            (Some(c), Some(k)) if c != k => {
                return Err(bad_flag(
                    flag,
                    arg,
                    "cpus= must equal cores= (one socket, one thread per core)",
                ))
            }
            (Some(c), _) | (None, Some(c)) => c,
            (None, None) => {
                return Err(bad_flag(
                    flag,
                    arg,
                    &format!("expected a vCPU count in 1..={MAX_VCPUS}"),
                ))
            }
        };
        if s.maxcpus.is_some_and(|m| m != cpus) {
            return Err(bad_flag(
                flag,
                arg,
                "maxcpus= must equal cpus= (no CPU hotplug)",
            ));
        }
        self.cfg.smp = cpus;
        Ok(())
    }

    fn drive(&mut self, flag: &str, arg: &str) -> Result<()> {
        let mut d = DriveSpec::default();
        let seen = apply(flag, &split_props(arg), DRIVE_PROPS, &mut d)?;
        require(&seen, flag, "file")?;
        if d.id.is_empty() {
            d.id = format!("drive{}", self.cfg.drives.len());
        }
        if self.cfg.drives.iter().any(|x| x.id == d.id) {
            return Err(CliError::Reference(format!(
                "duplicate drive id '{}'",
                d.id
            )));
        }
        if !d.if_none {
            self.cfg.devices.push(DeviceSpec::Blk(BlkSpec {
                common: PciCommon {
                    id: d.id.clone(),
                    ..PciCommon::default()
                },
                drive: d.id.clone(),
                ..BlkSpec::default()
            }));
        }
        self.cfg.drives.push(d);
        Ok(())
    }

    fn add_netdev(&mut self, n: NetdevSpec) -> Result<()> {
        if self.cfg.netdevs.iter().any(|x| x.id == n.id) {
            return Err(CliError::Reference(format!(
                "duplicate netdev id '{}'",
                n.id
            )));
        }
        self.cfg.netdevs.push(n);
        Ok(())
    }

    fn tap_backend(flag: &str, backend: &str) -> Result<String> {
        if backend != "tap" {
            return Err(bad_flag(flag, backend, "only tap is supported"));
        }
        Ok(format!("{flag} tap"))
    }

    fn netdev(&mut self, flag: &str, arg: &str) -> Result<()> {
        let (backend, items) = head_and_props(arg);
        let opt = Self::tap_backend(flag, &backend)?;
        let mut n = NetdevSpec {
            queues: 1,
            ..NetdevSpec::default()
        };
        let seen = apply(&opt, &items, TAP_PROPS, &mut n)?;
        require(&seen, &opt, "id")?;
        self.add_netdev(n)
    }

    /// `-nic tap,...`: a netdev and a virtio-net-pci on it in one flag, as in QEMU.
    fn nic(&mut self, flag: &str, arg: &str) -> Result<()> {
        let (backend, items) = head_and_props(arg);
        let opt = Self::tap_backend(flag, &backend)?;
        // Split the items between the device (model=, mac=) and the netdev (the rest).
        let (dev_items, tap_items): (Vec<String>, Vec<String>) = items.into_iter().partition(|i| {
            i.starts_with("model=") || i.starts_with("mac=") || i == "model" || i == "mac"
        });
        if tap_items.iter().any(|i| i.starts_with("id=")) {
            return Err(CliError::UnsupportedProperty {
                prop: "id".into(),
                opt,
            });
        }
        let id = format!("nic{}", self.nics);
        let mut n = NetdevSpec {
            id: id.clone(),
            queues: 1,
            ..NetdevSpec::default()
        };
        apply(&opt, &tap_items, TAP_PROPS, &mut n)?;
        let mut dev = NetSpec {
            common: PciCommon {
                id: id.clone(),
                ..PciCommon::default()
            },
            netdev: id,
            mq: n.queues > 1,
            ..NetSpec::default()
        };
        let table = [
            Prop::<NetSpec> {
                name: "model",
                set: |_, v| match v.str() {
                    "virtio-net-pci" | "virtio" => Ok(()),
                    _ => Err(v.bad("only virtio-net-pci (virtio) is supported")),
                },
            },
            Prop::<NetSpec> {
                name: "mac",
                set: NET_PROPS[1].set,
            },
        ];
        apply(&opt, &dev_items, &table, &mut dev)?;
        self.nics += 1;
        self.add_netdev(n)?;
        self.cfg.devices.push(DeviceSpec::Net(dev));
        Ok(())
    }

    fn device(&mut self, flag: &str, arg: &str) -> Result<()> {
        let (driver, items) = head_and_props(arg);
        let opt = format!("{flag} {driver}");
        let dev = match driver.as_str() {
            "virtio-blk-pci" => {
                let mut b = BlkSpec {
                    num_queues: 1,
                    ..BlkSpec::default()
                };
                let seen = apply(&opt, &items, &device_props(BLK_PROPS, &BLK_COMMON), &mut b)?;
                require(&seen, &opt, "drive")?;
                if b.common.id.is_empty() {
                    b.common.id = b.drive.clone();
                }
                DeviceSpec::Blk(b)
            }
            "virtio-net-pci" => {
                let mut n = NetSpec::default();
                let seen = apply(&opt, &items, &device_props(NET_PROPS, &NET_COMMON), &mut n)?;
                require(&seen, &opt, "netdev")?;
                if n.common.id.is_empty() {
                    n.common.id = n.netdev.clone();
                }
                DeviceSpec::Net(n)
            }
            "" => return Err(CliError::MissingArgument(flag.into())),
            other => {
                return Err(bad_flag(
                    flag,
                    other,
                    "unsupported device (virtio-blk-pci, virtio-net-pci)",
                ))
            }
        };
        self.cfg.devices.push(dev);
        Ok(())
    }

    fn serial(&mut self, flag: &str, arg: &str) -> Result<()> {
        match arg {
            "stdio" | "mon:stdio" => Ok(()),
            _ => Err(bad_flag(flag, arg, "only stdio is supported")),
        }
    }

    fn qmp(&mut self, flag: &str, arg: &str) -> Result<()> {
        let (first, items) = head_and_props(arg);
        let path = first
            .strip_prefix("unix:")
            .ok_or_else(|| bad_flag(flag, &first, "only unix:PATH is supported"))?;
        #[derive(Default)]
        struct Q {
            server: bool,
            wait: Option<bool>,
        }
        let table: &[Prop<Q>] = &[
            Prop {
                name: "server",
                set: |q, v| put(&mut q.server, v.bool()?),
            },
            Prop {
                name: "nowait",
                set: |q, _| put(&mut q.wait, Some(false)),
            },
            Prop {
                name: "wait",
                set: |q, v| put(&mut q.wait, Some(v.bool()?)),
            },
        ];
        let mut q = Q::default();
        apply(flag, &items, table, &mut q)?;
        if !q.server {
            return Err(CliError::MissingProperty {
                opt: flag.into(),
                prop: "server".into(),
            });
        }
        self.cfg.qmp = Some(QmpSpec {
            path: PathBuf::from(path),
            wait: q.wait.unwrap_or(true),
        });
        Ok(())
    }

    // Flag parsers end alike (bad_flag, Ok); each parses its own flag.
    fn bounce(&mut self, flag: &str, arg: &str) -> Result<()> {
        let mut id = None;
        let mut rest = Vec::new();
        for item in split_props(arg) {
            match item.strip_prefix("id=") {
                Some(d) => id = Some(d.to_string()),
                None => rest.push(item),
            }
        }
        let o: BounceOptions = rest
            .join(",")
            .parse()
            .map_err(|e| bad_flag(flag, arg, &format!("{e}")))?;
        match id {
            Some(d) => self.cfg.bounce.push((d, o)),
            None => self.cfg.bounce_default = Some(o),
        }
        Ok(())
    }

    /// `-machine [type=]q35[,accel=kvm,...]`: q35 describes bouncevm's PCI host bridge (ECAM,
    /// no ISA bridge model, no HPET, no SMM).
    fn machine(&mut self, flag: &str, arg: &str) -> Result<()> {
        let items = props_with_implied_key(arg, "type");
        // Same Prop-table shape as props.rs: each table has its own keys and refusals, no logic.
        let table: &[Prop<()>] = &[
            Prop {
                name: "type",
                set: |_, v| {
                    match v.str() {
                    "q35" | "pc-q35" => Ok(()),
                    t if t.starts_with("pc-q35-") => Ok(()),
                    _ => Err(v.bad("bouncevm's machine is q35-like (PCIe host bridge with ECAM); only q35 is accepted")),
                }
                },
            },
            Prop {
                name: "accel",
                set: |_, v| v.only("kvm", "only kvm is supported"),
            },
            KERNEL_IRQCHIP,
            Prop {
                name: "smm",
                set: |_, v| v.only_bool(false, "there is no SMM"),
            },
            Prop {
                name: "vmport",
                set: |_, v| v.only_bool(false, "there is no VMware I/O port"),
            },
            Prop {
                name: "hpet",
                set: |_, v| v.only_bool(false, "there is no HPET"),
            },
        ];
        apply(flag, &items, table, &mut ())?;
        Ok(())
    }

    fn accel(&mut self, flag: &str, arg: &str) -> Result<()> {
        let (accel, items) = head_and_props(arg);
        if accel != "kvm" {
            return Err(bad_flag(flag, &accel, "only kvm is supported"));
        }
        apply(&format!("{flag} kvm"), &items, &[KERNEL_IRQCHIP], &mut ())?;
        Ok(())
    }

    /// `-cpu host|max`: the guest sees KVM's supported CPUID (what both mean under KVM) with
    /// bouncevm's topology; no feature flags can be added or removed.
    fn cpu(&mut self, flag: &str, arg: &str) -> Result<()> {
        let (model, items) = head_and_props(arg);
        if model != "host" && model != "max" {
            return Err(bad_flag(
                flag,
                &model,
                "only host and max (KVM's supported CPUID) are supported",
            ));
        }
        apply(
            &format!("{flag} {model}"),
            &items,
            &[] as &[Prop<()>],
            &mut (),
        )?;
        Ok(())
    }

    fn name(&mut self, flag: &str, arg: &str) -> Result<()> {
        // Not props_with_implied_key: an empty `-name ""` still names the guest "".
        let mut items = split_props(arg);
        if items.first().is_some_and(|i| !i.contains('=')) {
            items[0] = format!("guest={}", items[0]);
        }
        let table: &[Prop<Option<String>>] = &[Prop {
            name: "guest",
            set: |n, v| put(n, Some(v.str().into())),
        }];
        let mut name = None;
        apply(flag, &items, table, &mut name)?;
        self.cfg.name = name;
        Ok(())
    }

    /// `-display none`, `-vga none`, `-monitor none`: bouncevm has none of them.
    fn none_only(&mut self, flag: &str, arg: &str) -> Result<()> {
        if arg == "none" {
            Ok(())
        } else {
            Err(bad_flag(flag, arg, "only none is supported"))
        }
    }

    /// Cross-checks references and fills per-device defaults.
    pub(super) fn finish(mut self) -> Result<Config> {
        let cfg = &mut self.cfg;
        let mut ids = std::collections::HashSet::new();
        let mut drives = Backends::new("drive", cfg.drives.iter().map(|x| x.id.as_str()));
        let mut netdevs = Backends::new("netdev", cfg.netdevs.iter().map(|x| x.id.as_str()));
        let mut default_macs = 0u8;
        for d in &mut cfg.devices {
            if !ids.insert(d.id().to_string()) {
                return Err(CliError::Reference(format!(
                    "duplicate device id '{}'",
                    d.id()
                )));
            }
            match d {
                DeviceSpec::Blk(b) => {
                    drives.claim("virtio-blk-pci", &b.drive)?;
                    if b.serial.is_empty() {
                        b.serial = b.drive.clone();
                    }
                }
                DeviceSpec::Net(n) => {
                    // As QEMU: "Property 'virtio-net-pci.netdev' can't take value, it's in use".
                    netdevs.claim("virtio-net-pci", &n.netdev)?;
                    if n.mac.is_none() {
                        let mut mac = DEFAULT_MAC;
                        mac[5] = mac[5].wrapping_add(default_macs);
                        default_macs = default_macs.wrapping_add(1);
                        n.mac = Some(mac);
                    }
                }
            }
        }
        for (id, _) in &cfg.bounce {
            if !ids.contains(id) {
                return Err(CliError::Reference(format!(
                    "-bounce id={id}: no device has this id"
                )));
            }
        }
        self.cfg.kernel = self.kernel.ok_or(CliError::NoKernel)?;
        Ok(self.cfg)
    }
}
