//! The `bouncevm` command line: a QEMU-compatible subset, parsed by hand into types.
//!
//! Every flag or property outside the subset is an error naming it (never silently ignored);
//! each error prints as one line. Flags QEMU users type out of habit are accepted where
//! bouncevm has the behaviour they ask for (`-cpu host`, `-machine q35`, `-display none`, ...)
//! and refused, naming the one flag or property, where it differs. See the crate README for
//! the table of what is accepted.
//!
//! Structure: [`FLAGS`] maps each flag to one parser function; options with `key=value`
//! properties (`-drive`, `-netdev`, `-device`, `-nic`) map each property to one setter in a
//! [`Prop`] table, so a new property is one row; [`Parser::finish`] cross-checks references
//! and fills in the per-device defaults (MAC, serial).

use std::path::PathBuf;

use devices::block::io::{AioMode, CacheMode, ImageFormat};
use devices::options::{parse_mac, BounceOptions, MAX_BLK_QUEUES};

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

/// The most vCPUs a machine can have: xAPIC ids 0..=253 next to the IOAPIC id (MP table and
/// MADT).
pub const MAX_VCPUS: u8 = 254;
/// The most queues of a `-netdev tap`.
pub const MAX_TAP_QUEUES: u16 = 16;
/// QEMU's first default MAC address; NIC `n` without `mac=` gets this plus `n`.
pub const DEFAULT_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];

/// `-drive`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DriveSpec {
    /// `id=` (generated as `drive0`, ... when absent).
    pub id: String,
    /// `file=`.
    pub file: PathBuf,
    /// `format=`; `None` means "probe and refuse a qcow2 image" (see [`devices::builder`]).
    pub format: Option<ImageFormat>,
    /// `if=virtio` (default) creates a virtio-blk-pci device; `if=none` waits for a `-device`.
    pub if_none: bool,
    /// `readonly=on`.
    pub readonly: bool,
    /// `aio=io_uring|threads|sync` (`None`: io_uring for raw images, threads for qcow2).
    pub aio: Option<AioMode>,
    /// `cache=none|writeback|writethrough|directsync|unsafe` (default writeback).
    pub cache: CacheMode,
}

/// `-netdev tap` (or the netdev half of `-nic tap`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NetdevSpec {
    /// `id=`.
    pub id: String,
    /// `ifname=`; `None`: the kernel picks a free `tapN` name, as QEMU does.
    pub ifname: Option<String>,
    /// `queues=` (default 1).
    pub queues: u16,
}

/// Properties every `virtio-*-pci` device has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciCommon {
    /// `id=` (defaults to the drive or netdev id).
    pub id: String,
    /// `iommu_platform=` (offer VIRTIO_F_ACCESS_PLATFORM; default on).
    pub iommu_platform: bool,
}

impl Default for PciCommon {
    fn default() -> Self {
        Self {
            id: String::new(),
            iommu_platform: true,
        }
    }
}

/// `-device virtio-blk-pci`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlkSpec {
    /// `id=`, `iommu_platform=`.
    pub common: PciCommon,
    /// `drive=`.
    pub drive: String,
    /// `num-queues=` (default 1).
    pub num_queues: u16,
    /// `queue-size=` (default 256, QEMU's).
    pub queue_size: u16,
    /// `logical_block_size=` (default 512).
    pub logical_block_size: u32,
    /// `serial=`; filled with the drive id when absent (each disk its own serial).
    pub serial: String,
}

impl Default for BlkSpec {
    /// QEMU's defaults: one queue of 256 entries, 512-byte blocks.
    fn default() -> Self {
        Self {
            common: PciCommon::default(),
            drive: String::new(),
            num_queues: 1,
            queue_size: 256,
            logical_block_size: 512,
            serial: String::new(),
        }
    }
}

/// `-device virtio-net-pci` (or the device half of `-nic`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NetSpec {
    /// `id=`, `iommu_platform=`.
    pub common: PciCommon,
    /// `netdev=`.
    pub netdev: String,
    /// `mac=`; filled with QEMU's default (52:54:00:12:34:56 + NIC index) when absent.
    pub mac: Option<[u8; 6]>,
    /// `mq=on`: one queue pair per netdev queue.
    pub mq: bool,
}

/// `-device`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    /// `virtio-blk-pci`.
    Blk(BlkSpec),
    /// `virtio-net-pci`.
    Net(NetSpec),
}

impl DeviceSpec {
    /// The device id.
    pub fn id(&self) -> &str {
        match self {
            DeviceSpec::Blk(b) => &b.common.id,
            DeviceSpec::Net(n) => &n.common.id,
        }
    }

    /// The QEMU driver name.
    pub fn driver(&self) -> &'static str {
        match self {
            DeviceSpec::Blk(_) => "virtio-blk-pci",
            DeviceSpec::Net(_) => "virtio-net-pci",
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
    /// `-name` (reported by `query-name`).
    pub name: Option<String>,
    /// `-drive`s.
    pub drives: Vec<DriveSpec>,
    /// `-netdev`s (and the netdevs of `-nic`).
    pub netdevs: Vec<NetdevSpec>,
    /// Devices: explicit `-device`s plus one per `-drive if=virtio` and `-nic`, in
    /// command-line order.
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
    /// `--socket-mode` (bouncevm's own flag): permission bits of the QMP socket (default
    /// [`bouncevm_common::sock::DEFAULT_SOCKET_MODE`], 0600).
    pub socket_mode: u32,
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
            .unwrap_or_else(BounceOptions::off)
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

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Run a VM.
    Run(Box<Config>),
    /// `-h`, `-help`, `--help`: print [`USAGE`] and exit 0.
    Help,
    /// `-version`, `--version`: print [`version_line`] and exit 0.
    Version,
}

/// `bouncevm --help`.
pub const USAGE: &str = "\
usage: bouncevm [options]
Boots a Linux kernel on KVM with virtio devices whose DMA goes through the bounce module.
QEMU-compatible subset (see vmm/README.md for every accepted property):
  -kernel FILE            bzImage or ELF vmlinux (PVH entry preferred); required
  -initrd FILE            initial ramdisk
  -append STRING          kernel command line
  -m [size=]SIZE          guest RAM: MiB, or with a K/M/G/T suffix, fractions allowed (default 512M)
  -smp [cpus=]N[,sockets=1,dies=1,cores=N,threads=1,maxcpus=N]   vCPUs, 1..=254 (default 1)
  -drive file=F[,format=raw|qcow2][,if=virtio|none][,id=ID][,readonly=on|off]
         [,aio=io_uring|threads|sync][,cache=none|writeback|writethrough|directsync|unsafe]
  -device virtio-blk-pci,drive=ID[,id=][,num-queues=N][,queue-size=N][,logical_block_size=N][,serial=S]
  -netdev tap,id=ID[,ifname=NAME][,queues=N][,script=no][,downscript=no]
  -device virtio-net-pci,netdev=ID[,id=][,mac=MAC][,mq=on|off]
  -nic tap[,ifname=NAME][,model=virtio-net-pci][,mac=MAC][,queues=N][,script=no][,downscript=no]
                          virtio devices also take iommu_platform=on|off, disable-legacy=on, disable-modern=off
  -bounce [id=DEV,]policy=off|force|mask=BITS[,mode=swiotlb|iova][,slots=N][,areas=N][,alloc=NAME][,workers=N][,on-full=wait|fail]
  -qmp unix:PATH,server[,wait=off|nowait]
  --socket-mode MODE      permission bits of the QMP socket (octal, default 0600)
  -serial stdio|mon:stdio, -nographic, -display none, -vga none, -monitor none, -nodefaults
  -machine|-M [type=]q35[,accel=kvm], -accel kvm, -enable-kvm, -cpu host|max, -name NAME
  -no-reboot              exit on guest reset (reboot is not implemented: a reset always exits)
  -no-acpi                no ACPI tables (a guest poweroff then only halts)
  -h, --help              this text;  -version, --version: the version
Logging: BOUNCEVM_LOG=info (tracing env-filter syntax; default warn).
";

/// `bouncevm -version`.
pub fn version_line() -> String {
    format!(
        "bouncevm version {} (QMP-compatible with QEMU's protocol)",
        env!("CARGO_PKG_VERSION")
    )
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

/// One `key[=value]` item of an option, as a property setter sees it.
#[derive(Debug)]
pub struct Val<'a> {
    opt: &'a str,
    key: &'a str,
    value: Option<&'a str>,
}

impl Val<'_> {
    /// The value (`""` for a bare key).
    pub fn str(&self) -> &str {
        self.value.unwrap_or("")
    }

    /// An error naming this property and its value.
    pub fn bad(&self, reason: &str) -> CliError {
        CliError::BadValue {
            what: format!("{} of {}", self.key, self.opt),
            value: self.str().into(),
            reason: reason.into(),
        }
    }

    /// `on|off` (also `yes|no`, `true|false`; a bare key means on, as in QEMU).
    pub fn bool(&self) -> Result<bool> {
        match self.value {
            None | Some("on" | "yes" | "true") => Ok(true),
            Some("off" | "no" | "false") => Ok(false),
            Some(_) => Err(self.bad("expected on or off")),
        }
    }

    /// A number in `lo..=hi`.
    pub fn number<T>(&self, lo: T, hi: T) -> Result<T>
    where
        T: std::str::FromStr + PartialOrd + std::fmt::Display,
    {
        self.str()
            .parse::<T>()
            .ok()
            .filter(|n| *n >= lo && *n <= hi)
            .ok_or_else(|| self.bad(&format!("expected a number in {lo}..={hi}")))
    }

    /// A non-empty string.
    pub fn nonempty(&self) -> Result<String> {
        match self.str() {
            "" => Err(self.bad("must not be empty")),
            s => Ok(s.to_string()),
        }
    }

    /// Accepts only `value`: QEMU's meaning of the other values is not what bouncevm does.
    pub fn only(&self, value: &str, why: &str) -> Result<()> {
        if self.str() == value {
            Ok(())
        } else {
            Err(self.bad(why))
        }
    }

    /// Accepts only a boolean equal to `value`.
    pub fn only_bool(&self, value: bool, why: &str) -> Result<()> {
        if self.bool()? == value {
            Ok(())
        } else {
            Err(self.bad(why))
        }
    }
}

/// One property of an option: its name and the function that stores it in `T`.
#[derive(Debug)]
pub struct Prop<T> {
    /// The key.
    pub name: &'static str,
    /// Stores the value (or refuses it).
    pub set: fn(&mut T, &Val) -> Result<()>,
}

/// Stores `value` in `slot` (the body of most property setters).
fn put<T>(slot: &mut T, value: T) -> Result<()> {
    *slot = value;
    Ok(())
}

/// Applies `items` to `target` through `table`: unknown keys and keys given twice are errors.
/// Returns the keys seen.
fn apply<T>(opt: &str, items: &[String], table: &[Prop<T>], target: &mut T) -> Result<Vec<String>> {
    let mut seen: Vec<String> = Vec::new();
    for item in items.iter().filter(|i| !i.is_empty()) {
        let (key, value) = match item.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (item.as_str(), None),
        };
        let val = Val { opt, key, value };
        if seen.iter().any(|k| k == key) {
            return Err(val.bad("given twice"));
        }
        let prop =
            table
                .iter()
                .find(|p| p.name == key)
                .ok_or_else(|| CliError::UnsupportedProperty {
                    prop: key.into(),
                    opt: opt.into(),
                })?;
        (prop.set)(target, &val)?;
        seen.push(key.to_string());
    }
    Ok(seen)
}

fn require(seen: &[String], opt: &str, prop: &str) -> Result<()> {
    if seen.iter().any(|k| k == prop) {
        Ok(())
    } else {
        Err(CliError::MissingProperty {
            opt: opt.into(),
            prop: prop.into(),
        })
    }
}

/// Parses sizes: a number of MiB, or with a `K`, `M`, `G`, `T` (or `B` for bytes) suffix; a
/// decimal fraction (`1.5G`) is allowed when the result is a whole number of bytes.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.strip_prefix("size=").unwrap_or(s);
    let (num, shift) = match s.chars().last()? {
        'b' | 'B' => (&s[..s.len() - 1], 0),
        'k' | 'K' => (&s[..s.len() - 1], 10),
        'm' | 'M' => (&s[..s.len() - 1], 20),
        'g' | 'G' => (&s[..s.len() - 1], 30),
        't' | 'T' => (&s[..s.len() - 1], 40),
        _ => (s, 20),
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() || !int.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) || frac.len() > 12 {
        return None;
    }
    let unit = 1u128 << shift;
    let whole = int.parse::<u128>().ok()?.checked_mul(unit)?;
    let mut part = 0u128;
    if !frac.is_empty() {
        let den = 10u128.pow(frac.len() as u32);
        let scaled = frac.parse::<u128>().ok()? * unit;
        if scaled % den != 0 {
            return None;
        }
        part = scaled / den;
    }
    u64::try_from(whole.checked_add(part)?).ok()
}

// ---- property tables ----

const DRIVE_PROPS: &[Prop<DriveSpec>] = &[
    Prop {
        name: "file",
        set: |d, v| put(&mut d.file, PathBuf::from(v.nonempty()?)),
    },
    Prop {
        name: "format",
        set: |d, v| {
            let f = v.str().parse().map_err(|e: String| v.bad(&e))?;
            put(&mut d.format, Some(f))
        },
    },
    Prop {
        name: "if",
        set: |d, v| {
            d.if_none = match v.str() {
                "virtio" => false,
                "none" => true,
                _ => return Err(v.bad("only virtio and none are supported")),
            };
            Ok(())
        },
    },
    Prop {
        name: "id",
        set: |d, v| put(&mut d.id, v.nonempty()?),
    },
    Prop {
        name: "readonly",
        set: |d, v| put(&mut d.readonly, v.bool()?),
    },
    Prop {
        name: "aio",
        set: |d, v| {
            let a = v.str().parse().map_err(|e: String| v.bad(&e))?;
            put(&mut d.aio, Some(a))
        },
    },
    Prop {
        name: "cache",
        set: |d, v| {
            let c = v.str().parse().map_err(|e: String| v.bad(&e))?;
            put(&mut d.cache, c)
        },
    },
];

/// The properties of `-netdev tap` (and of `-nic tap`).
const TAP_PROPS: &[Prop<NetdevSpec>] = &[
    Prop {
        name: "id",
        set: |n, v| put(&mut n.id, v.nonempty()?),
    },
    Prop {
        name: "ifname",
        set: |n, v| put(&mut n.ifname, Some(v.nonempty()?)),
    },
    Prop {
        name: "queues",
        set: |n, v| put(&mut n.queues, v.number(1, MAX_TAP_QUEUES)?),
    },
    Prop {
        name: "script",
        set: |_, v| v.only("no", "only 'no' is supported"),
    },
    Prop {
        name: "downscript",
        set: |_, v| v.only("no", "only 'no' is supported"),
    },
    Prop {
        name: "vhost",
        set: |_, v| v.only_bool(false, "vhost-net is not supported"),
    },
    Prop {
        name: "vnet_hdr",
        set: |_, v| v.only_bool(true, "the tap always has a virtio-net header"),
    },
];

/// The properties every virtio-pci device takes, written once; `$field` is the device's
/// [`PciCommon`].
macro_rules! pci_common_props {
    ($t:ty, $field:ident) => {
        [
            Prop::<$t> {
                name: "id",
                set: |d, v| put(&mut d.$field.id, v.nonempty()?),
            },
            Prop::<$t> {
                name: "iommu_platform",
                set: |d, v| put(&mut d.$field.iommu_platform, v.bool()?),
            },
            Prop::<$t> {
                name: "disable-legacy",
                set: |_, v| v.only_bool(true, "bouncevm's virtio-pci is modern-only"),
            },
            Prop::<$t> {
                name: "disable-modern",
                set: |_, v| v.only_bool(false, "bouncevm's virtio-pci is modern-only"),
            },
        ]
    };
}

const BLK_COMMON: [Prop<BlkSpec>; 4] = pci_common_props!(BlkSpec, common);
const BLK_PROPS: &[Prop<BlkSpec>] = &[
    Prop {
        name: "drive",
        set: |d, v| put(&mut d.drive, v.nonempty()?),
    },
    Prop {
        name: "num-queues",
        set: |d, v| put(&mut d.num_queues, v.number(1, MAX_BLK_QUEUES)?),
    },
    Prop {
        name: "queue-size",
        set: |d, v| {
            let n: u16 = v.number(2, 1024)?;
            if !n.is_power_of_two() {
                return Err(v.bad("expected a power of two"));
            }
            put(&mut d.queue_size, n)
        },
    },
    Prop {
        name: "logical_block_size",
        set: |d, v| {
            let n: u32 = v.number(512, 65536)?;
            if !n.is_power_of_two() {
                return Err(v.bad("expected a power of two"));
            }
            put(&mut d.logical_block_size, n)
        },
    },
    Prop {
        name: "serial",
        set: |d, v| put(&mut d.serial, v.str().to_string()),
    },
];

const NET_COMMON: [Prop<NetSpec>; 4] = pci_common_props!(NetSpec, common);
const NET_PROPS: &[Prop<NetSpec>] = &[
    Prop {
        name: "netdev",
        set: |d, v| put(&mut d.netdev, v.nonempty()?),
    },
    Prop {
        name: "mac",
        set: |d, v| put(&mut d.mac, Some(parse_mac(v.str()).map_err(|e| v.bad(&e))?)),
    },
    Prop {
        name: "mq",
        set: |d, v| put(&mut d.mq, v.bool()?),
    },
];

/// Looks `key` up in two tables (the device's own, then the common rows).
fn device_props<T>(own: &[Prop<T>], common: &[Prop<T>]) -> Vec<Prop<T>> {
    own.iter()
        .chain(common)
        .map(|p| Prop {
            name: p.name,
            set: p.set,
        })
        .collect()
}

/// `-smp` as given (see [`Parser::smp`]).
#[derive(Default)]
struct Smp {
    cpus: Option<u8>,
    cores: Option<u8>,
    maxcpus: Option<u8>,
}

/// `sockets=`, `dies=`, `threads=` must be 1: bouncevm presents N single-threaded cores of
/// one socket (see `boot::cpuid`).
fn only_one(v: &Val, what: &str) -> Result<()> {
    match v.number(1u8, MAX_VCPUS)? {
        1 => Ok(()),
        _ => Err(v.bad(&format!(
            "bouncevm presents one {what} (N cores of one socket, one thread each)"
        ))),
    }
}

const SMP_PROPS: &[Prop<Smp>] = &[
    Prop {
        name: "cpus",
        set: |s, v| put(&mut s.cpus, Some(v.number(1u8, MAX_VCPUS)?)),
    },
    Prop {
        name: "cores",
        set: |s, v| put(&mut s.cores, Some(v.number(1u8, MAX_VCPUS)?)),
    },
    Prop {
        name: "maxcpus",
        set: |s, v| put(&mut s.maxcpus, Some(v.number(1u8, MAX_VCPUS)?)),
    },
    Prop {
        name: "sockets",
        set: |_, v| only_one(v, "socket"),
    },
    Prop {
        name: "dies",
        set: |_, v| only_one(v, "die"),
    },
    Prop {
        name: "threads",
        set: |_, v| only_one(v, "thread per core"),
    },
];

// ---- the parser ----

/// The command line while it is being read.
#[derive(Debug)]
struct Parser {
    cfg: Config,
    kernel: Option<PathBuf>,
    nics: usize,
}

/// One flag: its spellings, whether it takes an argument, and its parser.
struct Flag {
    names: &'static [&'static str],
    arg: bool,
    parse: fn(&mut Parser, &str, &str) -> Result<()>,
}

/// Every flag bouncevm accepts (`-h`/`--help`/`-version` are handled before this table).
const FLAGS: &[Flag] = &[
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

fn bad_flag(flag: &str, value: &str, reason: &str) -> CliError {
    CliError::BadValue {
        what: flag.into(),
        value: value.into(),
        reason: reason.into(),
    }
}

/// Splits `first,k=v,...` into the leading name and the property items.
fn head_and_props(arg: &str) -> (String, Vec<String>) {
    let mut items = split_props(arg);
    let head = items.remove(0);
    (head, items)
}

impl Parser {
    fn new() -> Self {
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
        let mut items = split_props(arg);
        if items
            .first()
            .is_some_and(|i| !i.contains('=') && !i.is_empty())
        {
            items[0] = format!("cpus={}", items[0]);
        }
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
        let mut items = split_props(arg);
        if items
            .first()
            .is_some_and(|i| !i.contains('=') && !i.is_empty())
        {
            items[0] = format!("type={}", items[0]);
        }
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
            Prop {
                name: "kernel-irqchip",
                set: |_, v| v.only_bool(true, "the irqchip is always in the kernel"),
            },
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
        let table: &[Prop<()>] = &[Prop {
            name: "kernel-irqchip",
            set: |_, v| v.only_bool(true, "the irqchip is always in the kernel"),
        }];
        apply(&format!("{flag} kvm"), &items, table, &mut ())?;
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
    fn finish(mut self) -> Result<Config> {
        let cfg = &mut self.cfg;
        let mut ids = std::collections::HashSet::new();
        let mut used_drives = std::collections::HashSet::new();
        let mut used_netdevs = std::collections::HashSet::new();
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
                    if !cfg.drives.iter().any(|x| x.id == b.drive) {
                        return Err(CliError::Reference(format!(
                            "-device virtio-blk-pci: drive '{}' is not defined by a -drive",
                            b.drive
                        )));
                    }
                    if !used_drives.insert(b.drive.clone()) {
                        return Err(CliError::Reference(format!(
                            "drive '{}' is used by more than one device",
                            b.drive
                        )));
                    }
                    if b.serial.is_empty() {
                        b.serial = b.drive.clone();
                    }
                }
                DeviceSpec::Net(n) => {
                    if !cfg.netdevs.iter().any(|x| x.id == n.netdev) {
                        return Err(CliError::Reference(format!(
                            "-device virtio-net-pci: netdev '{}' is not defined by a -netdev",
                            n.netdev
                        )));
                    }
                    // As QEMU: "Property 'virtio-net-pci.netdev' can't take value, it's in use".
                    if !used_netdevs.insert(n.netdev.clone()) {
                        return Err(CliError::Reference(format!(
                            "netdev '{}' is used by more than one device",
                            n.netdev
                        )));
                    }
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

/// Parses the arguments after the program name.
///
/// # Errors
/// The first [`CliError`] found.
pub fn parse_action<I: IntoIterator<Item = String>>(args: I) -> Result<Action> {
    let mut it = args.into_iter();
    let mut p = Parser::new();
    while let Some(arg) = it.next() {
        // QEMU accepts --flag as -flag.
        let name = arg
            .strip_prefix('-')
            .filter(|s| s.starts_with('-'))
            .unwrap_or(&arg);
        match name {
            "-h" | "-help" => return Ok(Action::Help),
            "-version" => return Ok(Action::Version),
            _ => {}
        }
        let flag = FLAGS
            .iter()
            .find(|f| f.names.contains(&name))
            .ok_or_else(|| CliError::UnsupportedOption(name.to_string()))?;
        let value = if flag.arg {
            it.next()
                .ok_or_else(|| CliError::MissingArgument(name.to_string()))?
        } else {
            String::new()
        };
        (flag.parse)(&mut p, name, &value)?;
    }
    Ok(Action::Run(Box::new(p.finish()?)))
}

/// Parses a command line that must run a VM (`--help`/`-version` are errors here).
///
/// # Errors
/// The first [`CliError`] found.
pub fn parse<I: IntoIterator<Item = String>>(args: I) -> Result<Config> {
    match parse_action(args)? {
        Action::Run(c) => Ok(*c),
        Action::Help => Err(CliError::UnsupportedOption("-help".into())),
        Action::Version => Err(CliError::UnsupportedOption("-version".into())),
    }
}

/// The flag spellings bouncevm accepts (for the README table check).
pub fn accepted_flags() -> Vec<&'static str> {
    let mut v: Vec<&str> = FLAGS.iter().flat_map(|f| f.names.iter().copied()).collect();
    v.extend(["-h", "-help", "-version"]);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &[&str]) -> Result<Config> {
        parse(s.iter().map(|s| s.to_string()))
    }

    fn e(a: &[&str]) -> String {
        p(a).unwrap_err().to_string()
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
        let DeviceSpec::Blk(b) = &c.devices[1] else {
            panic!()
        };
        assert_eq!((b.num_queues, b.common.iommu_platform), (2, false));
        assert_eq!((b.queue_size, b.logical_block_size), (256, 512));
        let DeviceSpec::Net(n) = &c.devices[2] else {
            panic!()
        };
        assert!(n.mq);
        assert_eq!(n.mac, Some([0x52, 0x54, 0, 0, 0, 1]));
        assert!(c.drives[1].readonly && c.drives[1].if_none);
        assert_eq!(c.drives[0].format, Some(ImageFormat::Raw));
        assert_eq!(c.netdevs[0].queues, 2);
        assert_eq!(c.qmp.as_ref().map(|q| q.wait), Some(false));
        assert_eq!(c.bounce_for("drive0").policy, bounce::Policy::Force);
        assert_eq!(c.bounce_for("n0").policy, bounce::Policy::Off);
        assert!(c.no_reboot);
        assert!(!c.no_acpi);
    }

    #[test]
    fn usual_qemu_lines_are_accepted() {
        let c = p(&[
            "-kernel",
            "k",
            "-cpu",
            "host",
            "-machine",
            "q35,accel=kvm",
            "-M",
            "q35",
            "-accel",
            "kvm,kernel-irqchip=on",
            "-display",
            "none",
            "-vga",
            "none",
            "-nodefaults",
            "-monitor",
            "none",
            "-name",
            "guest1",
            "-enable-kvm",
            "-smp",
            "4,sockets=1,cores=4,threads=1",
            "-m",
            "1.5G",
            "-drive",
            "file=a.img,if=none,id=d0",
            "-device",
            "virtio-blk-pci,drive=d0,disable-legacy=on,disable-modern=off",
            "-nic",
            "tap,model=virtio-net-pci,mac=52-54-00-00-00-09",
            "-nic",
            "tap,ifname=t1,script=no,downscript=no",
        ])
        .unwrap();
        assert_eq!(c.smp, 4);
        assert_eq!(c.mem_size, 3 << 29);
        assert_eq!(c.name.as_deref(), Some("guest1"));
        assert_eq!(c.drives[0].format, None, "no format= means probe");
        let macs: Vec<_> = c
            .devices
            .iter()
            .filter_map(|d| match d {
                DeviceSpec::Net(n) => n.mac,
                _ => None,
            })
            .collect();
        assert_eq!(macs, vec![[0x52, 0x54, 0, 0, 0, 9], DEFAULT_MAC]);
        assert_eq!(c.netdevs[0].ifname, None);
        assert_eq!(c.netdevs[1].ifname.as_deref(), Some("t1"));
        assert_eq!(p(&["-kernel", "k", "-smp", "cpus=3"]).unwrap().smp, 3);
        assert_eq!(p(&["-kernel", "k", "-smp", "cores=5"]).unwrap().smp, 5);
        assert_eq!(p(&["-kernel", "k", "-smp", "254"]).unwrap().smp, 254);
        assert_eq!(
            p(&["-kernel", "k", "--no-acpi"]).map(|c| c.no_acpi),
            Ok(true)
        );
    }

    #[test]
    fn help_and_version() {
        let a = |s: &str| parse_action([s.to_string()]).unwrap();
        assert_eq!(a("-h"), Action::Help);
        assert_eq!(a("--help"), Action::Help);
        assert_eq!(a("-help"), Action::Help);
        assert_eq!(a("-version"), Action::Version);
        assert_eq!(a("--version"), Action::Version);
    }

    #[test]
    fn every_nic_and_disk_gets_its_own_default() {
        let c = p(&[
            "-kernel",
            "k",
            "-netdev",
            "tap,id=a,ifname=ta",
            "-netdev",
            "tap,id=b,ifname=tb",
            "-device",
            "virtio-net-pci,netdev=a",
            "-device",
            "virtio-net-pci,netdev=b",
            "-drive",
            "file=x",
            "-drive",
            "file=y,id=disk1",
        ])
        .unwrap();
        let mut macs = Vec::new();
        let mut serials = Vec::new();
        for d in &c.devices {
            match d {
                DeviceSpec::Net(n) => macs.push(n.mac.unwrap()),
                DeviceSpec::Blk(b) => serials.push(b.serial.clone()),
            }
        }
        assert_eq!(macs[0], DEFAULT_MAC);
        assert_eq!(macs[1][5], 0x57);
        assert_eq!(serials, vec!["drive0", "disk1"]);
        assert!(e(&[
            "-kernel",
            "k",
            "-netdev",
            "tap,id=a",
            "-device",
            "virtio-net-pci,netdev=a",
            "-device",
            "virtio-net-pci,netdev=a,id=second"
        ])
        .contains("netdev 'a' is used by more than one device"));
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
    fn errors_name_the_flag_or_property() {
        assert_eq!(e(&["-foo"]), "unsupported option -foo");
        assert!(e(&["-kernel", "k", "-machine", "pc"]).contains("type of -machine"));
        assert!(e(&["-kernel", "k", "-machine", "q35,smm=on"]).contains("smm of -machine"));
        assert!(e(&["-kernel", "k", "-M", "q35,usb=on"]).contains("'usb' of -M"));
        assert!(e(&["-kernel", "k", "-cpu", "qemu64"]).contains("-cpu"));
        assert_eq!(
            e(&["-kernel", "k", "-cpu", "host,+x2apic"]),
            "unsupported property '+x2apic' of -cpu host"
        );
        assert!(e(&["-kernel", "k", "-display", "gtk"]).contains("-display"));
        assert!(e(&["-kernel", "k", "-smp", "255"]).contains("1..=254"));
        assert!(e(&["-kernel", "k", "-smp", "4,sockets=2,cores=2"]).contains("sockets of -smp"));
        assert!(e(&["-kernel", "k", "-smp", "4,threads=2"]).contains("threads of -smp"));
        assert!(e(&["-kernel", "k", "-smp", "4,maxcpus=8"]).contains("hotplug"));
        assert!(e(&["-kernel", "k", "-m", "1.3333M"]).contains("-m"));
        assert!(e(&["-kernel", "k", "-m", "1G,maxmem=2G"]).contains("'maxmem' of -m"));
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
        assert!(e(&[
            "-kernel",
            "k",
            "-drive",
            "file=a,if=none,id=d",
            "-device",
            "virtio-blk-pci,drive=d,disable-legacy=off"
        ])
        .contains("disable-legacy"));
        assert!(e(&["-kernel", "k", "-device", "e1000"]).contains("'e1000'"));
        assert!(e(&["-kernel", "k", "-device", "virtio-blk-pci,drive=nope"]).contains("'nope'"));
        assert_eq!(e(&["-m"]), "option -m requires an argument");
        assert!(e(&["-m", "lots"]).contains("-m"));
        assert_eq!(e(&["-m", "1G"]), "no kernel given (-kernel is required)");
        assert!(e(&["-kernel", "k", "-qmp", "tcp:1:2,server"]).contains("-qmp"));
        assert!(e(&["-kernel", "k", "-bounce", "policy=sometimes"]).contains("-bounce"));
        assert!(e(&["-kernel", "k", "-netdev", "user,id=n"]).contains("only tap"));
        assert!(e(&["-kernel", "k", "-nic", "user"]).contains("only tap"));
        assert!(e(&["-kernel", "k", "-nic", "tap,model=e1000"]).contains("model of -nic tap"));
        assert!(e(&["-kernel", "k", "-accel", "tcg"]).contains("-accel"));
        assert!(e(&["-kernel", "k", "-accel", "kvm,dirty-ring-size=4096"])
            .contains("'dirty-ring-size' of -accel kvm"));
        assert!(
            e(&["-kernel", "k", "-drive", "file=a,readonly=on,readonly=off"])
                .contains("given twice")
        );
        assert!(e(&["-kernel", "k", "-drive", "format=raw"]).contains("-drive requires file="));
    }

    #[test]
    fn sizes_macs_and_escaped_commas() {
        assert_eq!(parse_size("512"), Some(512 << 20));
        assert_eq!(parse_size("2G"), Some(2 << 30));
        assert_eq!(parse_size("1.5G"), Some(3 << 29));
        assert_eq!(parse_size("0.5M"), Some(1 << 19));
        assert_eq!(parse_size("4096B"), Some(4096));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(".5G"), None);
        assert_eq!(parse_size("99999999999T"), None);
        assert_eq!(
            parse_mac("52:54:00:ab:cd:ef"),
            Ok([0x52, 0x54, 0, 0xab, 0xcd, 0xef])
        );
        assert_eq!(
            parse_mac("52-54-00-ab-cd-ef"),
            Ok([0x52, 0x54, 0, 0xab, 0xcd, 0xef])
        );
        assert!(parse_mac("52:54:00:ab:cd").is_err());
        assert!(parse_mac("52:54:00:ab:cd:e").is_err());
        assert!(parse_mac("52:54-00:ab:cd:ef").is_err());
        assert_eq!(
            devices::options::format_mac(&DEFAULT_MAC),
            "52:54:00:12:34:56"
        );
        assert_eq!(
            split_props("file=a,,b,format=raw"),
            vec!["file=a,b", "format=raw"]
        );
    }
}
