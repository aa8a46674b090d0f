//! What the command line asks for, as types: [`Config`] and the drive, netdev and device
//! specs it holds.

use std::path::PathBuf;

use devices::block::io::{AioMode, CacheMode, ImageFormat};
use devices::options::BounceOptions;

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

// Field list of the parsed command line; alike in shape only to other option structs.
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
