//! Loading and starting a Linux kernel.
//!
//! [`load_kernel`] accepts an ELF `vmlinux` (entered through its PVH note when it has one,
//! else at its 64-bit ELF entry) or a bzImage (entered at the 64-bit entry, load address +
//! 0x200). [`setup_linux`] then loads the command line and initrd, writes the e820 map into
//! boot_params (or the PVH start info), writes the MP table, passes the ACPI RSDP address
//! when there is one, and returns the
//! [`EntryState`] for the boot vCPU. CPUID/MSRs/FPU/LAPIC are per vCPU and set by
//! [`crate::machine::Machine::configure_linux_vcpus`].

use std::fs::File;
use std::path::{Path, PathBuf};

use linux_loader::bootparam::{boot_e820_entry, boot_params, setup_header};
use linux_loader::cmdline::Cmdline;
use linux_loader::loader::bzimage::BzImage;
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::KernelLoader;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryMmap};

use super::e820::{e820_map, E820Entry};
use super::mptable;
use super::regs::EntryState;
use crate::layout::{
    CMDLINE_MAX_SIZE, CMDLINE_START, HIMEM_START, PVH_INFO_START, PVH_MEMMAP_MAX_ENTRIES,
    PVH_MEMMAP_START, ZERO_PAGE_START,
};
use crate::memory::RamRange;

/// `boot_flag` magic of the setup header.
pub const BOOT_FLAG_MAGIC: u16 = 0xaa55;
/// `header` magic ("HdrS").
pub const HDRS_MAGIC: u32 = 0x5372_6448;
/// `type_of_loader` for an unregistered boot loader.
pub const LOADER_TYPE_UNDEFINED: u8 = 0xff;
/// `loadflags` bit: kernel loaded high (at 1 MiB).
pub const LOADED_HIGH: u8 = 0x01;
/// PVH `hvm_start_info` magic.
pub const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
/// Offset of the 64-bit entry point from the start of a bzImage's protected-mode kernel.
pub const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;
/// PVH module list goes after the memmap entries, within the PVH page.
const PVH_MODLIST_START: u64 = ZERO_PAGE_START - 0x40;

/// Errors of Linux boot setup.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Opening or reading a file failed.
    #[error("{path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The kernel is neither a loadable ELF nor a bzImage.
    #[error("cannot load kernel {path}: as ELF: {elf}; as bzImage: {bzimage}")]
    Kernel {
        /// The file.
        path: PathBuf,
        /// The ELF loader's error.
        elf: linux_loader::loader::Error,
        /// The bzImage loader's error.
        bzimage: linux_loader::loader::Error,
    },
    /// The command line is too long or invalid.
    #[error("kernel command line: {0}")]
    Cmdline(linux_loader::cmdline::Error),
    /// Writing the command line failed.
    #[error("loading the command line: {0}")]
    LoadCmdline(linux_loader::loader::Error),
    /// The initrd does not fit between the kernel and the end of low RAM.
    #[error(
        "initrd of {size} bytes does not fit below {limit:#x} above the kernel end {kernel_end:#x}"
    )]
    InitrdTooBig {
        /// Initrd size.
        size: u64,
        /// Highest usable address.
        limit: u64,
        /// End of the kernel image.
        kernel_end: u64,
    },
    /// The memory map is invalid.
    #[error(transparent)]
    E820(#[from] super::e820::Error),
    /// The map has more entries than the boot structure can hold.
    #[error("{0} e820 entries do not fit the boot structure")]
    TooManyE820(usize),
    /// Writing the MP table failed.
    #[error(transparent)]
    MpTable(#[from] mptable::Error),
    /// Writing guest memory failed.
    #[error("writing boot data: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
    /// An address does not fit the 32-bit field the boot protocol gives it.
    #[error("{what} address {addr:#x} is above 4 GiB")]
    Above4G {
        /// The field.
        what: &'static str,
        /// The address.
        addr: u64,
    },
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, Error>;

/// How the kernel is entered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelEntry {
    /// PVH: 32-bit flat entry with `hvm_start_info` in EBX.
    Pvh(u64),
    /// ELF 64-bit entry with boot_params in RSI.
    Elf64(u64),
    /// bzImage 64-bit entry with boot_params in RSI (the setup header from the image).
    BzImage(u64),
}

/// A loaded kernel.
#[derive(Debug, Clone, Copy)]
pub struct LoadedKernel {
    /// Entry point and protocol.
    pub entry: KernelEntry,
    /// First byte after the kernel image in guest memory.
    pub end: u64,
    /// The bzImage setup header, if any.
    pub setup_header: Option<setup_header>,
}

// Field list of the boot configuration; alike in shape only to other record structs.
/// What to boot.
#[derive(Debug, Clone)]
pub struct LinuxBootConfig {
    /// Kernel image (vmlinux ELF or bzImage).
    pub kernel: PathBuf,
    /// Optional initial ramdisk.
    pub initrd: Option<PathBuf>,
    /// Kernel command line.
    pub cmdline: String,
    /// Enter a PVH-capable ELF kernel through PVH (true) or its 64-bit ELF entry (false).
    pub prefer_pvh: bool,
}

fn open(path: &Path) -> Result<File> {
    File::open(path).map_err(|source| Error::File {
        path: path.to_owned(),
        source,
    })
}

/// Loads `path` (ELF first, then bzImage) at [`HIMEM_START`].
///
/// # Errors
/// [`Error::File`], [`Error::Kernel`].
pub fn load_kernel(mem: &GuestMemoryMmap, path: &Path, prefer_pvh: bool) -> Result<LoadedKernel> {
    let mut f = open(path)?;
    let himem = Some(GuestAddress(HIMEM_START));
    let elf = match Elf::load(mem, None, &mut f, himem) {
        Ok(r) => {
            let entry = match r.pvh_boot_cap {
                PvhBootCapability::PvhEntryPresent(a) if prefer_pvh => {
                    KernelEntry::Pvh(a.raw_value())
                }
                _ => KernelEntry::Elf64(r.kernel_load.raw_value()),
            };
            return Ok(LoadedKernel {
                entry,
                end: r.kernel_end,
                setup_header: None,
            });
        }
        Err(e) => e,
    };
    match BzImage::load(mem, None, &mut f, himem) {
        Ok(r) => Ok(LoadedKernel {
            entry: KernelEntry::BzImage(r.kernel_load.raw_value() + BZIMAGE_64BIT_ENTRY_OFFSET),
            end: r.kernel_end,
            setup_header: r.setup_header,
        }),
        Err(bzimage) => Err(Error::Kernel {
            path: path.to_owned(),
            elf,
            bzimage,
        }),
    }
}

/// Chooses the initrd address: page-aligned, as high as possible below `limit` (the end of
/// low RAM, capped by the kernel's `initrd_addr_max`), and above `kernel_end`.
///
/// # Errors
/// [`Error::InitrdTooBig`].
pub fn initrd_address(size: u64, limit: u64, kernel_end: u64) -> Result<u64> {
    let err = Error::InitrdTooBig {
        size,
        limit,
        kernel_end,
    };
    let addr = limit.checked_sub(size).ok_or(err)? & !0xfff;
    if addr < kernel_end {
        return Err(Error::InitrdTooBig {
            size,
            limit,
            kernel_end,
        });
    }
    Ok(addr)
}

fn load_initrd(
    mem: &GuestMemoryMmap,
    path: &Path,
    limit: u64,
    kernel_end: u64,
) -> Result<(u64, u64)> {
    let mut f = open(path)?;
    let size = f
        .metadata()
        .map_err(|source| Error::File {
            path: path.to_owned(),
            source,
        })?
        .len();
    let addr = initrd_address(size, limit, kernel_end)?;
    let len = usize::try_from(size).map_err(|_| Error::InitrdTooBig {
        size,
        limit,
        kernel_end,
    })?;
    mem.read_exact_volatile_from(GuestAddress(addr), &mut f, len)?;
    Ok((addr, size))
}

/// Builds the zero page for `header` (or a minimal one for an ELF kernel).
///
/// # Errors
/// [`Error::TooManyE820`], [`Error::Above4G`].
pub fn build_boot_params(
    header: Option<setup_header>,
    cmdline_len: usize,
    initrd: Option<(u64, u64)>,
    e820: &[E820Entry],
) -> Result<boot_params> {
    let mut p = boot_params::default();
    if let Some(h) = header {
        p.hdr = h;
    }
    p.hdr.boot_flag = BOOT_FLAG_MAGIC;
    p.hdr.header = HDRS_MAGIC;
    p.hdr.type_of_loader = LOADER_TYPE_UNDEFINED;
    p.hdr.loadflags |= LOADED_HIGH;
    if p.hdr.kernel_alignment == 0 {
        p.hdr.kernel_alignment = 0x0100_0000;
    }
    p.hdr.cmd_line_ptr = CMDLINE_START as u32;
    p.hdr.cmdline_size = cmdline_len as u32;
    if let Some((addr, size)) = initrd {
        p.hdr.ramdisk_image = u32::try_from(addr).map_err(|_| Error::Above4G {
            what: "initrd",
            addr,
        })?;
        p.hdr.ramdisk_size = u32::try_from(size).map_err(|_| Error::Above4G {
            what: "initrd size",
            addr: size,
        })?;
    }
    if e820.len() > p.e820_table.len() {
        return Err(Error::TooManyE820(e820.len()));
    }
    for (slot, e) in p.e820_table.iter_mut().zip(e820) {
        *slot = boot_e820_entry {
            addr: e.addr,
            size: e.size,
            r#type: e.kind,
        };
    }
    p.e820_entries = e820.len() as u8;
    Ok(p)
}

/// Builds the PVH start info and memory map.
///
/// # Errors
/// [`Error::TooManyE820`].
pub fn build_pvh_start_info(
    initrd: Option<(u64, u64)>,
    e820: &[E820Entry],
) -> Result<(
    hvm_start_info,
    Vec<hvm_memmap_table_entry>,
    Option<hvm_modlist_entry>,
)> {
    if e820.len() > PVH_MEMMAP_MAX_ENTRIES {
        return Err(Error::TooManyE820(e820.len()));
    }
    let memmap: Vec<hvm_memmap_table_entry> = e820
        .iter()
        .map(|e| hvm_memmap_table_entry {
            addr: e.addr,
            size: e.size,
            type_: e.kind,
            reserved: 0,
        })
        .collect();
    let module = initrd.map(|(paddr, size)| hvm_modlist_entry {
        paddr,
        size,
        ..Default::default()
    });
    let info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        nr_modules: u32::from(module.is_some()),
        modlist_paddr: if module.is_some() {
            PVH_MODLIST_START
        } else {
            0
        },
        cmdline_paddr: CMDLINE_START,
        memmap_paddr: PVH_MEMMAP_START,
        memmap_entries: memmap.len() as u32,
        ..Default::default()
    };
    Ok((info, memmap, module))
}

/// Loads everything for `cfg` into `mem` for a VM with `ram` and `num_cpus` vCPUs and
/// returns the boot vCPU's entry state (no ACPI RSDP passed).
///
/// # Errors
/// Any of this module's errors.
pub fn setup_linux(
    mem: &GuestMemoryMmap,
    ram: &[RamRange],
    num_cpus: usize,
    cfg: &LinuxBootConfig,
) -> Result<EntryState> {
    setup_linux_with_acpi(mem, ram, num_cpus, cfg, None)
}

/// [`setup_linux`], also handing the kernel the ACPI RSDP address `rsdp` (written by
/// [`super::acpi::write_acpi_tables`]): in boot_params `acpi_rsdp_addr` for the 64-bit
/// entries, in the PVH start info `rsdp_paddr` for PVH. Linux also finds the RSDP by its
/// legacy scan of 0xE0000-0xFFFFF.
///
/// # Errors
/// Any of this module's errors.
pub fn setup_linux_with_acpi(
    mem: &GuestMemoryMmap,
    ram: &[RamRange],
    num_cpus: usize,
    cfg: &LinuxBootConfig,
    rsdp: Option<u64>,
) -> Result<EntryState> {
    let e820 = e820_map(ram)?;
    let kernel = load_kernel(mem, &cfg.kernel, cfg.prefer_pvh)?;
    tracing::info!(entry = ?kernel.entry, end = kernel.end, "kernel loaded");

    let mut cmdline = Cmdline::new(CMDLINE_MAX_SIZE).map_err(Error::Cmdline)?;
    cmdline.insert_str(&cfg.cmdline).map_err(Error::Cmdline)?;
    linux_loader::loader::load_cmdline(mem, GuestAddress(CMDLINE_START), &cmdline)
        .map_err(Error::LoadCmdline)?;

    let low_end = ram.first().map_or(0, |r| r.end());
    let initrd = match &cfg.initrd {
        Some(path) => {
            let max = kernel
                .setup_header
                .map(|h| u64::from(h.initrd_addr_max))
                .filter(|&m| m != 0)
                .map_or(low_end, |m| low_end.min(m + 1));
            Some(load_initrd(mem, path, max, kernel.end)?)
        }
        None => None,
    };
    mptable::write_mptable(mem, num_cpus)?;

    match kernel.entry {
        KernelEntry::Pvh(entry) => {
            let (mut info, memmap, module) = build_pvh_start_info(initrd, &e820)?;
            info.rsdp_paddr = rsdp.unwrap_or(0);
            mem.write_obj(info, GuestAddress(PVH_INFO_START))?;
            for (i, m) in memmap.iter().enumerate() {
                mem.write_obj(*m, GuestAddress(PVH_MEMMAP_START + 24 * i as u64))?;
            }
            if let Some(m) = module {
                mem.write_obj(m, GuestAddress(PVH_MODLIST_START))?;
            }
            let entry = u32::try_from(entry).map_err(|_| Error::Above4G {
                what: "PVH entry",
                addr: entry,
            })?;
            Ok(EntryState::pvh(entry, PVH_INFO_START as u32))
        }
        KernelEntry::Elf64(entry) | KernelEntry::BzImage(entry) => {
            let mut params =
                build_boot_params(kernel.setup_header, cfg.cmdline.len() + 1, initrd, &e820)?;
            params.acpi_rsdp_addr = rsdp.unwrap_or(0);
            mem.write_obj(params, GuestAddress(ZERO_PAGE_START))?;
            Ok(EntryState::linux64(entry, ZERO_PAGE_START))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::ram_ranges;

    #[test]
    fn boot_params_fields() {
        let e820 = e820_map(&ram_ranges(256 << 20).unwrap()).unwrap();
        let p = build_boot_params(None, 20, Some((0x0f00_0000, 0x10_0000)), &e820).unwrap();
        // Copy out of the packed struct before comparing.
        let (flag, hdr, ptr, size) = (
            p.hdr.boot_flag,
            p.hdr.header,
            p.hdr.cmd_line_ptr,
            p.hdr.cmdline_size,
        );
        assert_eq!((flag, hdr, ptr, size), (0xaa55, 0x5372_6448, 0x20000, 20));
        let (rd, rs, tl) = (
            p.hdr.ramdisk_image,
            p.hdr.ramdisk_size,
            p.hdr.type_of_loader,
        );
        assert_eq!((rd, rs, tl), (0x0f00_0000, 0x10_0000, 0xff));
        assert_eq!(p.e820_entries, 4);
        let last = p.e820_table[3];
        let (addr, size, kind) = (last.addr, last.size, last.r#type);
        assert_eq!((addr, size, kind), (0x10_0000, (256 << 20) - 0x10_0000, 1));
        assert!(matches!(
            build_boot_params(None, 1, Some((1 << 32, 1)), &e820),
            Err(Error::Above4G { .. })
        ));
    }

    #[test]
    fn pvh_info() {
        let e820 = e820_map(&ram_ranges(256 << 20).unwrap()).unwrap();
        let (info, map, module) = build_pvh_start_info(Some((0x0800_0000, 42)), &e820).unwrap();
        assert_eq!(info.magic, XEN_HVM_START_MAGIC);
        assert_eq!(info.memmap_entries, 4);
        assert_eq!(info.nr_modules, 1);
        assert_eq!(map[3].addr, HIMEM_START);
        assert_eq!(module.unwrap().size, 42);
        // The memmap and module list fit between the start info and the zero page.
        assert!(PVH_MEMMAP_START + 24 * map.len() as u64 <= PVH_MODLIST_START);
        assert!(PVH_INFO_START + std::mem::size_of::<hvm_start_info>() as u64 <= PVH_MEMMAP_START);
    }

    #[test]
    fn initrd_placement() {
        assert_eq!(
            initrd_address(0x1800, 0x10_0000, 0x8_0000).unwrap(),
            0xf_e000
        );
        assert!(initrd_address(0x10_0000, 0x10_0000, 0x1000).is_err());
        assert!(initrd_address(u64::MAX, 0x10_0000, 0).is_err());
    }

    #[test]
    fn garbage_kernel_is_rejected() {
        let dir = std::env::temp_dir().join(format!("vmm-kernel-test-{}", std::process::id()));
        std::fs::write(&dir, vec![0x42u8; 8192]).unwrap();
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        let r = load_kernel(&mem, &dir, true);
        let _ = std::fs::remove_file(&dir);
        assert!(matches!(r, Err(Error::Kernel { .. })), "{r:?}");
    }
}
