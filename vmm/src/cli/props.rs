//! Properties: `key[=value]` items of an option, each stored by one setter of a [`Prop`]
//! table, and the tables of `-drive`, `-netdev tap`, the virtio-pci devices and `-smp`.

use std::path::PathBuf;

use devices::options::{parse_mac, MAX_BLK_QUEUES};

use super::spec::{BlkSpec, DriveSpec, NetSpec, NetdevSpec};
use super::{CliError, Result, MAX_TAP_QUEUES, MAX_VCPUS};

/// Splits `a,b=c,d` into items; `,,` is a literal comma (QEMU's escaping).
pub(super) fn split_props(s: &str) -> Vec<String> {
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

    /// The value parsed by its type's `FromStr` (whose error is the reason given).
    pub fn parsed<T: std::str::FromStr<Err = String>>(&self) -> Result<T> {
        self.str().parse().map_err(|e: String| self.bad(&e))
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

    /// A power of two in `lo..=hi`.
    pub fn power_of_two<T>(&self, lo: T, hi: T) -> Result<T>
    where
        T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy + Into<u64>,
    {
        let n = self.number(lo, hi)?;
        if n.into().is_power_of_two() {
            Ok(n)
        } else {
            Err(self.bad("expected a power of two"))
        }
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
pub(super) fn put<T>(slot: &mut T, value: T) -> Result<()> {
    *slot = value;
    Ok(())
}

/// Applies `items` to `target` through `table`: unknown keys and keys given twice are errors.
/// Returns the keys seen.
pub(super) fn apply<T>(
    opt: &str,
    items: &[String],
    table: &[Prop<T>],
    target: &mut T,
) -> Result<Vec<String>> {
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

/// Fails naming `prop` unless it was among the keys `seen`.
pub(super) fn require(seen: &[String], opt: &str, prop: &str) -> Result<()> {
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

// Property tables, one per option: the same Prop shape with each its own keys and checks.
pub(super) const DRIVE_PROPS: &[Prop<DriveSpec>] = &[
    Prop {
        name: "file",
        set: |d, v| put(&mut d.file, PathBuf::from(v.nonempty()?)),
    },
    Prop {
        name: "format",
        set: |d, v| put(&mut d.format, Some(v.parsed()?)),
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
        set: |d, v| put(&mut d.aio, Some(v.parsed()?)),
    },
    Prop {
        name: "cache",
        set: |d, v| put(&mut d.cache, v.parsed()?),
    },
];

/// The properties of `-netdev tap` (and of `-nic tap`).
pub(super) const TAP_PROPS: &[Prop<NetdevSpec>] = &[
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

pub(super) const BLK_COMMON: [Prop<BlkSpec>; 4] = pci_common_props!(BlkSpec, common);
pub(super) const BLK_PROPS: &[Prop<BlkSpec>] = &[
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
        set: |d, v| put(&mut d.queue_size, v.power_of_two::<u16>(2, 1024)?),
    },
    Prop {
        name: "logical_block_size",
        set: |d, v| {
            put(
                &mut d.logical_block_size,
                v.power_of_two::<u32>(512, 65536)?,
            )
        },
    },
    Prop {
        name: "serial",
        set: |d, v| put(&mut d.serial, v.str().to_string()),
    },
];

pub(super) const NET_COMMON: [Prop<NetSpec>; 4] = pci_common_props!(NetSpec, common);
pub(super) const NET_PROPS: &[Prop<NetSpec>] = &[
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
pub(super) fn device_props<T>(own: &[Prop<T>], common: &[Prop<T>]) -> Vec<Prop<T>> {
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
pub(super) struct Smp {
    pub cpus: Option<u8>,
    pub cores: Option<u8>,
    pub maxcpus: Option<u8>,
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

pub(super) const SMP_PROPS: &[Prop<Smp>] = &[
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
