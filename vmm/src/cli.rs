//! The `bouncevm` command line: a QEMU-compatible subset, parsed by hand into types.
//!
//! Every flag or property outside the subset is an error naming it (never silently ignored);
//! each error prints as one line. See the crate README for the full syntax.

use std::path::PathBuf;

use devices::block::io::{AioMode, CacheMode, ImageFormat};

use crate::options::BounceOptions;

/// Errors of the command line; each displays as one line naming the flag or property.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CliError {
    /// A flag we do not support.
    #[error("unsupported option {0}")]
    UnsupportedOption(String),
    /// A flag without its argument.
    #[error("option {0} requires an argument")]
    MissingArgument(String),
    /// A property we do not support.
    #[error("unsupported property '{prop}' of {opt}")]
    UnsupportedProperty {
        /// The property.
        prop: String,
        /// The flag (and driver).
        opt: String,
    },
    /// A value that does not parse or is not supported.
    #[error("invalid value '{value}' for {what}: {reason}")]
    BadValue {
        /// Property or flag.
        what: String,
        /// The value.
        value: String,
        /// Why.
        reason: String,
    },
    /// A required property is missing.
    #[error("{opt} requires {prop}=")]
    MissingProperty {
        /// The flag (and driver).
        opt: String,
        /// The property.
        prop: String,
    },
    /// A reference to an id that no `-drive`/`-netdev` defines, or a duplicate id.
    #[error("{0}")]
    Reference(String),
    /// No kernel.
    #[error("no kernel given (-kernel is required)")]
    NoKernel,
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, CliError>;

/// `-drive`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriveSpec {
    /// `id=` (generated as `drive0`, ... when absent).
    pub id: String,
    /// `file=`.
    pub file: PathBuf,
    /// `format=` (default raw).
    pub format: ImageFormat,
    /// `if=virtio` (default) creates a virtio-blk-pci device; `if=none` waits for a `-device`.
    pub if_virtio: bool,
    /// `readonly=on`.
    pub readonly: bool,
    /// `aio=io_uring|threads|sync` (default: the image format's engine).
    pub aio: Option<AioMode>,
    /// `cache=none|writeback|writethrough|directsync|unsafe` (default writeback).
    pub cache: CacheMode,
}

/// `-netdev tap`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetdevSpec {
    /// `id=`.
    pub id: String,
    /// `ifname=`.
    pub ifname: String,
    /// `queues=` (default 1).
    pub queues: u16,
}

/// `-device`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    /// `virtio-blk-pci`.
    Blk {
        /// `id=` (defaults to the drive id).
        id: String,
        /// `drive=`.
        drive: String,
        /// `num-queues=` (default 1).
        num_queues: u16,
        /// `serial=`.
        serial: Option<String>,
        /// `iommu_platform=` (offer VIRTIO_F_ACCESS_PLATFORM; default on).
        iommu_platform: bool,
    },
    /// `virtio-net-pci`.
    Net {
        /// `id=` (defaults to the netdev id).
        id: String,
        /// `netdev=`.
        netdev: String,
        /// `mac=`.
        mac: Option<[u8; 6]>,
        /// `mq=on`: one queue pair per netdev queue.
        mq: bool,
        /// `iommu_platform=` (default on).
        iommu_platform: bool,
    },
}

impl DeviceSpec {
    /// The device id.
    pub fn id(&self) -> &str {
        match self {
            DeviceSpec::Blk { id, .. } | DeviceSpec::Net { id, .. } => id,
        }
    }
}

/// `-qmp unix:PATH,server[,nowait]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QmpSpec {
    /// Socket path.
    pub path: PathBuf,
    /// Wait for a client before starting the guest (QEMU's default for `server`).
    pub wait: bool,
}

/// The whole command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// `-m` in bytes (default 512 MiB).
    pub mem_size: u64,
    /// `-smp` (default 1).
    pub smp: u8,
    /// `-kernel`.
    pub kernel: PathBuf,
    /// `-initrd`.
    pub initrd: Option<PathBuf>,
    /// `-append`.
    pub append: String,
    /// `-drive`s.
    pub drives: Vec<DriveSpec>,
    /// `-netdev`s.
    pub netdevs: Vec<NetdevSpec>,
    /// Devices: explicit `-device`s plus one per `-drive if=virtio`, in command-line order.
    pub devices: Vec<DeviceSpec>,
    /// `-no-reboot`.
    pub no_reboot: bool,
    /// `-no-acpi`: no ACPI tables and no PM registers (the MP table alone describes the
    /// machine; a guest `poweroff` then only halts).
    pub no_acpi: bool,
    /// `-qmp`.
    pub qmp: Option<QmpSpec>,
    /// `-bounce` without `id=`: the default for every device (bouncing is off otherwise).
    pub bounce_default: Option<BounceOptions>,
    /// `-bounce id=DEV,...`.
    pub bounce: Vec<(String, BounceOptions)>,
}

impl Config {
    /// The bounce options of device `id`: its own, else the default, else off.
    pub fn bounce_for(&self, id: &str) -> BounceOptions {
        self.bounce
            .iter()
            .rev()
            .find(|(d, _)| d == id)
            .map(|(_, o)| o.clone())
            .or_else(|| self.bounce_default.clone())
            .unwrap_or_default()
    }

    /// The drive a device refers to.
    pub fn drive(&self, id: &str) -> Option<&DriveSpec> {
        self.drives.iter().find(|d| d.id == id)
    }

    /// The netdev a device refers to.
    pub fn netdev(&self, id: &str) -> Option<&NetdevSpec> {
        self.netdevs.iter().find(|d| d.id == id)
    }
}

/// Splits `a,b=c,d` into items; `,,` is a literal comma (QEMU's escaping).
fn split_props(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                cur.push(',');
            } else {
                out.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(c);
        }
    }
    out.push(cur);
    out
}

/// `key=value` pairs of an option (after its optional leading driver/backend name).
struct Props {
    opt: String,
    items: Vec<(String, Option<String>)>,
}

impl Props {
    fn new(opt: &str, items: &[String]) -> Result<Self> {
        let mut v: Vec<(String, Option<String>)> = Vec::new();
        for i in items.iter().filter(|i| !i.is_empty()) {
            let (k, val) = match i.split_once('=') {
                Some((k, val)) => (k.to_string(), Some(val.to_string())),
                None => (i.clone(), None),
            };
            if v.iter().any(|(p, _)| *p == k) {
                return Err(CliError::BadValue {
                    what: format!("{k} of {opt}"),
                    value: val.unwrap_or_default(),
                    reason: "given twice".into(),
                });
            }
            v.push((k, val));
        }
        Ok(Props {
            opt: opt.to_string(),
            items: v,
        })
    }

    /// Rejects any property not in `allowed`.
    fn only(&self, allowed: &[&str]) -> Result<()> {
        for (k, _) in &self.items {
            if !allowed.contains(&k.as_str()) {
                return Err(CliError::UnsupportedProperty {
                    prop: k.clone(),
                    opt: self.opt.clone(),
                });
            }
        }
        Ok(())
    }

    fn get(&self, k: &str) -> Option<&str> {
        self.items
            .iter()
            .find(|(p, _)| p == k)
            .map(|(_, v)| v.as_deref().unwrap_or(""))
    }

    fn has(&self, k: &str) -> bool {
        self.items.iter().any(|(p, _)| p == k)
    }

    fn require(&self, k: &str) -> Result<&str> {
        match self.get(k) {
            Some(v) if !v.is_empty() => Ok(v),
            _ => Err(CliError::MissingProperty {
                opt: self.opt.clone(),
                prop: k.into(),
            }),
        }
    }

    fn bad(&self, k: &str, value: &str, reason: &str) -> CliError {
        CliError::BadValue {
            what: format!("{k} of {}", self.opt),
            value: value.into(),
            reason: reason.into(),
        }
    }

    fn bool(&self, k: &str, default: bool) -> Result<bool> {
        // A bare `key` means on, as in QEMU.
        if self.items.iter().any(|(p, v)| p == k && v.is_none()) {
            return Ok(true);
        }
        match self.get(k) {
            None => Ok(default),
            Some("on" | "yes" | "true") => Ok(true),
            Some("off" | "no" | "false") => Ok(false),
            Some(v) => Err(self.bad(k, v, "expected on or off")),
        }
    }

    fn number<T: std::str::FromStr>(&self, k: &str, default: T) -> Result<T> {
        match self.get(k) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| self.bad(k, v, "expected a number")),
        }
    }
}

/// Parses `-m` sizes: a number of MiB, or with a `K`, `M`, `G` or `T` suffix.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.strip_prefix("size=").unwrap_or(s);
    let (num, shift) = match s.chars().last()? {
        'k' | 'K' => (&s[..s.len() - 1], 10),
        'm' | 'M' => (&s[..s.len() - 1], 20),
        'g' | 'G' => (&s[..s.len() - 1], 30),
        't' | 'T' => (&s[..s.len() - 1], 40),
        _ => (s, 20),
    };
    num.parse::<u64>().ok()?.checked_mul(1u64 << shift)
}

/// Parses a MAC address `52:54:00:12:34:56`.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let parts: Vec<&str> = s.split(':').collect();
    if parts.len() != 6 {
        return None;
    }
    for (m, p) in mac.iter_mut().zip(parts) {
        if p.len() != 2 {
            return None;
        }
        *m = u8::from_str_radix(p, 16).ok()?;
    }
    Some(mac)
}

/// Parses the arguments after the program name.
///
/// # Errors
/// The first [`CliError`] found.
pub fn parse<I: IntoIterator<Item = String>>(args: I) -> Result<Config> {
    let mut it = args.into_iter();
    let mut mem_size = 512u64 << 20;
    let mut smp = 1u8;
    let mut kernel = None;
    let mut initrd = None;
    let mut append = String::new();
    let mut drives: Vec<DriveSpec> = Vec::new();
    let mut netdevs: Vec<NetdevSpec> = Vec::new();
    // Devices with the position of the flag, so implicit drives keep command-line order.
    let mut devices: Vec<DeviceSpec> = Vec::new();
    let mut no_reboot = false;
    let mut no_acpi = false;
    let mut qmp = None;
    let mut bounce_default = None;
    let mut bounce = Vec::new();

    while let Some(flag) = it.next() {
        // QEMU accepts --flag as -flag.
        let name = if flag.starts_with("--") {
            &flag[1..]
        } else {
            flag.as_str()
        };
        let takes_arg = matches!(
            name,
            "-m" | "-smp"
                | "-kernel"
                | "-initrd"
                | "-append"
                | "-drive"
                | "-netdev"
                | "-device"
                | "-serial"
                | "-qmp"
                | "-bounce"
                | "-accel"
        );
        let arg = if takes_arg {
            Some(
                it.next()
                    .ok_or_else(|| CliError::MissingArgument(name.to_string()))?,
            )
        } else {
            None
        };
        let arg = arg.unwrap_or_default();
        match name {
            "-m" => {
                mem_size = parse_size(&arg)
                    .filter(|&s| s >= 16 << 20 && s % 4096 == 0)
                    .ok_or_else(|| CliError::BadValue {
                        what: "-m".into(),
                        value: arg.clone(),
                        reason: "expected SIZE[M|G] of at least 16M".into(),
                    })?;
            }
            "-smp" => {
                let v = arg.strip_prefix("cpus=").unwrap_or(&arg);
                smp =
                    v.parse::<u8>()
                        .ok()
                        .filter(|&n| n >= 1)
                        .ok_or_else(|| CliError::BadValue {
                            what: "-smp".into(),
                            value: arg.clone(),
                            reason: "expected a vCPU count in 1..=255".into(),
                        })?;
            }
            "-kernel" => kernel = Some(PathBuf::from(arg)),
            "-initrd" => initrd = Some(PathBuf::from(arg)),
            "-append" => append = arg,
            "-drive" => {
                let p = Props::new("-drive", &split_props(&arg))?;
                p.only(&["file", "format", "if", "id", "readonly", "aio", "cache"])?;
                let file = PathBuf::from(p.require("file")?);
                let format = match p.get("format") {
                    None => ImageFormat::Raw,
                    Some(f) => f.parse().map_err(|e: String| p.bad("format", f, &e))?,
                };
                let if_virtio = match p.get("if") {
                    None | Some("virtio") => true,
                    Some("none") => false,
                    Some(v) => return Err(p.bad("if", v, "only virtio and none are supported")),
                };
                let id = match p.get("id") {
                    Some(id) if !id.is_empty() => id.to_string(),
                    _ => format!("drive{}", drives.len()),
                };
                if drives.iter().any(|d| d.id == id) {
                    return Err(CliError::Reference(format!("duplicate drive id '{id}'")));
                }
                let readonly = p.bool("readonly", false)?;
                let aio = match p.get("aio") {
                    None => None,
                    Some(v) => Some(v.parse().map_err(|e: String| p.bad("aio", v, &e))?),
                };
                let cache = match p.get("cache") {
                    None => CacheMode::default(),
                    Some(v) => v.parse().map_err(|e: String| p.bad("cache", v, &e))?,
                };
                if if_virtio {
                    devices.push(DeviceSpec::Blk {
                        id: id.clone(),
                        drive: id.clone(),
                        num_queues: 1,
                        serial: None,
                        iommu_platform: true,
                    });
                }
                drives.push(DriveSpec {
                    id,
                    file,
                    format,
                    if_virtio,
                    readonly,
                    aio,
                    cache,
                });
            }
            "-netdev" => {
                let items = split_props(&arg);
                let backend = items.first().cloned().unwrap_or_default();
                if backend != "tap" {
                    return Err(CliError::BadValue {
                        what: "-netdev".into(),
                        value: backend,
                        reason: "only tap is supported".into(),
                    });
                }
                let p = Props::new("-netdev tap", &items[1..])?;
                p.only(&["id", "ifname", "queues", "script", "downscript", "vhost"])?;
                for k in ["script", "downscript"] {
                    if let Some(v) = p.get(k) {
                        if v != "no" {
                            return Err(p.bad(k, v, "only 'no' is supported"));
                        }
                    }
                }
                if p.bool("vhost", false)? {
                    return Err(p.bad("vhost", "on", "vhost-net is not supported"));
                }
                let id = p.require("id")?.to_string();
                if netdevs.iter().any(|n| n.id == id) {
                    return Err(CliError::Reference(format!("duplicate netdev id '{id}'")));
                }
                let queues: u16 = p.number("queues", 1)?;
                if queues == 0 || queues > 16 {
                    return Err(p.bad("queues", &queues.to_string(), "expected 1..=16"));
                }
                netdevs.push(NetdevSpec {
                    id,
                    ifname: p.require("ifname")?.to_string(),
                    queues,
                });
            }
            "-device" => {
                let items = split_props(&arg);
                let driver = items.first().cloned().unwrap_or_default();
                let opt = format!("-device {driver}");
                let p = Props::new(&opt, &items[1..])?;
                let dev = match driver.as_str() {
                    "virtio-blk-pci" => {
                        p.only(&["drive", "id", "num-queues", "serial", "iommu_platform"])?;
                        let drive = p.require("drive")?.to_string();
                        let num_queues: u16 = p.number("num-queues", 1)?;
                        if num_queues == 0 || num_queues > 64 {
                            return Err(p.bad(
                                "num-queues",
                                &num_queues.to_string(),
                                "expected 1..=64",
                            ));
                        }
                        DeviceSpec::Blk {
                            id: p.get("id").unwrap_or(&drive).to_string(),
                            drive,
                            num_queues,
                            serial: p.get("serial").map(str::to_string),
                            iommu_platform: p.bool("iommu_platform", true)?,
                        }
                    }
                    "virtio-net-pci" => {
                        p.only(&["netdev", "id", "mac", "mq", "iommu_platform"])?;
                        let netdev = p.require("netdev")?.to_string();
                        let mac = match p.get("mac") {
                            None => None,
                            Some(m) => Some(
                                parse_mac(m)
                                    .ok_or_else(|| p.bad("mac", m, "expected xx:xx:xx:xx:xx:xx"))?,
                            ),
                        };
                        DeviceSpec::Net {
                            id: p.get("id").unwrap_or(&netdev).to_string(),
                            netdev,
                            mac,
                            mq: p.bool("mq", false)?,
                            iommu_platform: p.bool("iommu_platform", true)?,
                        }
                    }
                    "" => return Err(CliError::MissingArgument("-device".into())),
                    other => {
                        return Err(CliError::BadValue {
                            what: "-device".into(),
                            value: other.into(),
                            reason: "unsupported device (virtio-blk-pci, virtio-net-pci)".into(),
                        })
                    }
                };
                devices.push(dev);
            }
            "-nographic" => {}
            "-serial" => {
                if arg != "stdio" && arg != "mon:stdio" {
                    return Err(CliError::BadValue {
                        what: "-serial".into(),
                        value: arg,
                        reason: "only stdio is supported".into(),
                    });
                }
            }
            "-no-reboot" => no_reboot = true,
            "-no-acpi" => no_acpi = true,
            "-accel" | "-enable-kvm" => {
                if name == "-accel" && arg != "kvm" {
                    return Err(CliError::BadValue {
                        what: "-accel".into(),
                        value: arg,
                        reason: "only kvm is supported".into(),
                    });
                }
            }
            "-qmp" => {
                let items = split_props(&arg);
                let first = items.first().cloned().unwrap_or_default();
                let path = first
                    .strip_prefix("unix:")
                    .ok_or_else(|| CliError::BadValue {
                        what: "-qmp".into(),
                        value: first.clone(),
                        reason: "only unix:PATH is supported".into(),
                    })?;
                let p = Props::new("-qmp", &items[1..])?;
                p.only(&["server", "nowait", "wait"])?;
                if !p.bool("server", false)? {
                    return Err(CliError::MissingProperty {
                        opt: "-qmp".into(),
                        prop: "server".into(),
                    });
                }
                let wait = !p.has("nowait") && p.bool("wait", true)?;
                qmp = Some(QmpSpec {
                    path: PathBuf::from(path),
                    wait,
                });
            }
            "-bounce" => {
                let mut id = None;
                let mut rest = Vec::new();
                for item in split_props(&arg) {
                    match item.strip_prefix("id=") {
                        Some(d) => id = Some(d.to_string()),
                        None => rest.push(item),
                    }
                }
                let o: BounceOptions = rest.join(",").parse().map_err(|e| CliError::BadValue {
                    what: "-bounce".into(),
                    value: arg.clone(),
                    reason: format!("{e}"),
                })?;
                match id {
                    Some(d) => bounce.push((d, o)),
                    None => bounce_default = Some(o),
                }
            }
            other => return Err(CliError::UnsupportedOption(other.to_string())),
        }
    }

    // Cross-references.
    let mut ids = std::collections::HashSet::new();
    let mut used_drives = std::collections::HashSet::new();
    for d in &devices {
        if !ids.insert(d.id().to_string()) {
            return Err(CliError::Reference(format!(
                "duplicate device id '{}'",
                d.id()
            )));
        }
        match d {
            DeviceSpec::Blk { drive, .. } => {
                if !drives.iter().any(|x| &x.id == drive) {
                    return Err(CliError::Reference(format!(
                        "-device virtio-blk-pci: drive '{drive}' is not defined by a -drive"
                    )));
                }
                if !used_drives.insert(drive.clone()) {
                    return Err(CliError::Reference(format!(
                        "drive '{drive}' is used by more than one device"
                    )));
                }
            }
            DeviceSpec::Net { netdev, .. } => {
                if !netdevs.iter().any(|x| &x.id == netdev) {
                    return Err(CliError::Reference(format!(
                        "-device virtio-net-pci: netdev '{netdev}' is not defined by a -netdev"
                    )));
                }
            }
        }
    }
    for (id, _) in &bounce {
        if !ids.contains(id) {
            return Err(CliError::Reference(format!(
                "-bounce id={id}: no device has this id"
            )));
        }
    }
    Ok(Config {
        mem_size,
        smp,
        kernel: kernel.ok_or(CliError::NoKernel)?,
        initrd,
        append,
        drives,
        netdevs,
        devices,
        no_reboot,
        no_acpi,
        qmp,
        bounce_default,
        bounce,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &[&str]) -> Result<Config> {
        parse(s.iter().map(|s| s.to_string()))
    }

    #[test]
    fn full_command_line_parses() {
        let c = p(&[
            "-m",
            "1G",
            "-smp",
            "2",
            "-kernel",
            "k",
            "-initrd",
            "i",
            "-append",
            "console=ttyS0",
            "-drive",
            "file=a.img,format=raw,if=virtio",
            "-drive",
            "file=b.qcow2,format=qcow2,if=none,id=d1,readonly=on",
            "-device",
            "virtio-blk-pci,drive=d1,num-queues=2,serial=abc,iommu_platform=off",
            "-netdev",
            "tap,id=n0,ifname=tap0,queues=2,script=no,downscript=no",
            "-device",
            "virtio-net-pci,netdev=n0,mac=52:54:00:00:00:01,mq=on",
            "-nographic",
            "-serial",
            "stdio",
            "-no-reboot",
            "-qmp",
            "unix:/tmp/q.sock,server,nowait",
            "-bounce",
            "policy=force,alloc=areas",
            "-bounce",
            "id=n0,policy=off",
            "-accel",
            "kvm",
        ])
        .unwrap();
        assert_eq!(c.mem_size, 1 << 30);
        assert_eq!(c.smp, 2);
        assert_eq!(c.devices.len(), 3);
        assert_eq!(c.devices[0].id(), "drive0");
        assert!(matches!(
            &c.devices[1],
            DeviceSpec::Blk {
                num_queues: 2,
                iommu_platform: false,
                ..
            }
        ));
        assert!(matches!(
            &c.devices[2],
            DeviceSpec::Net {
                mq: true,
                mac: Some(_),
                ..
            }
        ));
        assert!(c.drives[1].readonly && !c.drives[1].if_virtio);
        assert_eq!(c.netdevs[0].queues, 2);
        assert_eq!(c.qmp.as_ref().map(|q| q.wait), Some(false));
        assert_eq!(c.bounce_for("drive0").policy, bounce::Policy::Force);
        assert_eq!(c.bounce_for("n0").policy, bounce::Policy::Off);
        assert!(c.no_reboot);
        assert!(!c.no_acpi);
    }

    #[test]
    fn drive_aio_and_cache_use_qemus_names() {
        let c = p(&["-kernel", "k", "-drive", "file=a,aio=threads,cache=none"]).unwrap();
        assert_eq!(c.drives[0].aio, Some(AioMode::Threads));
        assert_eq!(c.drives[0].cache, CacheMode::None);
        let c = p(&["-kernel", "k", "-drive", "file=a"]).unwrap();
        assert_eq!(
            (c.drives[0].aio, c.drives[0].cache),
            (None, CacheMode::Writeback)
        );
    }

    #[test]
    fn no_acpi_flag() {
        assert!(p(&["-kernel", "k", "-no-acpi"]).unwrap().no_acpi);
    }

    #[test]
    fn errors_name_the_flag_or_property() {
        let e = |a: &[&str]| p(a).unwrap_err().to_string();
        assert_eq!(e(&["-foo"]), "unsupported option -foo");
        assert_eq!(
            e(&["-kernel", "k", "-machine", "q35"]),
            "unsupported option -machine"
        );
        assert_eq!(
            e(&["-kernel", "k", "-drive", "file=a,snapshot=on"]),
            "unsupported property 'snapshot' of -drive"
        );
        assert!(e(&["-kernel", "k", "-drive", "file=a,cache=off"]).contains("directsync"));
        assert!(e(&["-kernel", "k", "-drive", "file=a,aio=native"]).contains("io_uring"));
        assert_eq!(
            e(&[
                "-kernel",
                "k",
                "-drive",
                "file=a,if=none,id=d",
                "-device",
                "virtio-blk-pci,drive=d,x=1"
            ]),
            "unsupported property 'x' of -device virtio-blk-pci"
        );
        assert!(e(&["-kernel", "k", "-device", "e1000"]).contains("'e1000'"));
        assert!(e(&["-kernel", "k", "-device", "virtio-blk-pci,drive=nope"]).contains("'nope'"));
        assert_eq!(e(&["-m"]), "option -m requires an argument");
        assert!(e(&["-m", "lots"]).contains("-m"));
        assert_eq!(e(&["-m", "1G"]), "no kernel given (-kernel is required)");
        assert!(e(&["-kernel", "k", "-qmp", "tcp:1:2,server"]).contains("-qmp"));
        assert!(e(&["-kernel", "k", "-bounce", "policy=sometimes"]).contains("-bounce"));
        assert!(e(&["-kernel", "k", "-netdev", "user,id=n"]).contains("only tap"));
        assert!(e(&["-kernel", "k", "-accel", "tcg"]).contains("-accel"));
    }

    #[test]
    fn sizes_macs_and_escaped_commas() {
        assert_eq!(parse_size("512"), Some(512 << 20));
        assert_eq!(parse_size("2G"), Some(2 << 30));
        assert_eq!(parse_size("x"), None);
        assert_eq!(
            parse_mac("52:54:00:ab:cd:ef"),
            Some([0x52, 0x54, 0, 0xab, 0xcd, 0xef])
        );
        assert_eq!(parse_mac("52:54:00:ab:cd"), None);
        assert_eq!(
            split_props("file=a,,b,format=raw"),
            vec!["file=a,b", "format=raw"]
        );
    }
}
