//! The `bouncevm` command line: a QEMU-compatible subset, parsed by hand into types.
//!
//! Every flag or property outside the subset is an error naming it (never silently ignored);
//! each error prints as one line. Flags QEMU users type out of habit are accepted where
//! bouncevm has the behaviour they ask for (`-cpu host`, `-machine q35`, `-display none`, ...)
//! and refused, naming the one flag or property, where it differs. See the crate README for
//! the table of what is accepted.
//!
//! Structure:
//! - [`spec`]: what the command line asks for, as types ([`Config`] and the specs it holds);
//! - [`props`]: options with `key=value` properties (`-drive`, `-netdev`, `-device`, `-nic`,
//!   `-smp`) map each property to one setter in a [`Prop`] table, so a new property is one row;
//! - `parser`: a table maps each flag to one parser function; a last pass cross-checks
//!   references and fills in the per-device defaults (MAC, serial).

mod parser;
pub mod props;
pub mod spec;
#[cfg(test)]
mod tests;

pub use props::{parse_size, Prop, Val};
pub use spec::{BlkSpec, Config, DeviceSpec, DriveSpec, NetSpec, NetdevSpec, PciCommon, QmpSpec};

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
  -bounce [id=DEV,]policy=off|force|mask=BITS[,mode=swiotlb|iova][,slots=N][,areas=N][,alloc=NAME][,workers=N][,on-full=wait|fail][,dynamic=on|off][,dynamic-slots=N][,pool=NAME]
                          pool=NAME: the devices that name NAME share one pool (same pool keys), else each has its own
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

/// Parses the arguments after the program name.
///
/// # Errors
/// The first [`CliError`] found.
pub fn parse_action<I: IntoIterator<Item = String>>(args: I) -> Result<Action> {
    let mut it = args.into_iter();
    let mut p = parser::Parser::new();
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
        let flag = parser::FLAGS
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
    let mut v: Vec<&str> = parser::FLAGS
        .iter()
        .flat_map(|f| f.names.iter().copied())
        .collect();
    v.extend(["-h", "-help", "-version"]);
    v
}
