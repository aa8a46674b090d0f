//! Device construction shared by `bouncevm` (virtio-pci) and `bouncevm-vhost` (vhost-user):
//! image opening with format probing, the bounce pool, the tap and the device core, built
//! the same way whichever transport serves them.
//!
//! ```no_run
//! use devices::block::BlockConfig;
//! use devices::builder;
//! use devices::options::BounceOptions;
//! use devices::pools::PoolRegistry;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let bounce: BounceOptions = "policy=force,slots=4096".parse()?;
//! let mut pools = PoolRegistry::default();
//! let cfg = BlockConfig::default();
//! let blk = builder::block("disk.img".as_ref(), None, false, cfg, &bounce, &mut pools, "disk0")?;
//! assert!(blk.pool.is_some());
//! # Ok(())
//! # }
//! ```

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::block::io::ImageFormat;
use crate::block::{Block, BlockConfig, DiskImage};
use crate::net::{Net, NetBackend, NetConfig, Tap};
use crate::options::{BounceOptions, OptionsError};
use crate::pools::PoolRegistry;
use bounce::BouncePool;

/// The qcow2 magic, `QFI\xfb`, at offset 0 of every qcow2 image.
pub const QCOW2_MAGIC: [u8; 4] = *b"QFI\xfb";

/// Errors of device construction; each displays as one line.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The bounce options cannot build a pool.
    #[error("bounce: {0}")]
    Bounce(#[from] OptionsError),
    /// The image cannot be opened.
    #[error("cannot open image '{path}': {source}")]
    Image {
        /// The file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// No format was given and the image is qcow2: exposing its bytes as a raw disk would
    /// let the guest overwrite the qcow2 metadata (QEMU warns; bouncevm refuses).
    #[error("'{0}' is a qcow2 image: give format=qcow2 (or format=raw to expose its bytes)")]
    Qcow2NotNamed(PathBuf),
    /// The tap cannot be opened.
    #[error("tap: {0}")]
    Tap(String),
    /// The device core refuses its configuration.
    #[error("{0}")]
    Device(String),
}

/// A device core and the bounce pool its DMA goes through (none when not bouncing).
#[derive(Debug)]
pub struct Built<D> {
    /// The device.
    pub device: D,
    /// Its pool, for statistics.
    pub pool: Option<Arc<BouncePool>>,
}

/// The format of `path`: `format` when given, else raw unless the file starts with the
/// qcow2 magic, which is an error ([`BuildError::Qcow2NotNamed`]).
///
/// # Errors
/// [`BuildError::Image`], [`BuildError::Qcow2NotNamed`].
pub fn probe_format(path: &Path, format: Option<ImageFormat>) -> Result<ImageFormat, BuildError> {
    if let Some(f) = format {
        return Ok(f);
    }
    let image = |source| BuildError::Image {
        path: path.to_path_buf(),
        source,
    };
    let mut head = [0u8; 4];
    let mut f = std::fs::File::open(path).map_err(image)?;
    let mut got = 0;
    while got < head.len() {
        match f.read(&mut head[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(image(e)),
        }
    }
    if got == head.len() && head == QCOW2_MAGIC {
        return Err(BuildError::Qcow2NotNamed(path.to_path_buf()));
    }
    Ok(ImageFormat::Raw)
}

/// Opens `path` (see [`probe_format`]).
///
/// # Errors
/// Those of [`probe_format`]; [`BuildError::Image`].
pub fn open_image(
    path: &Path,
    format: Option<ImageFormat>,
    readonly: bool,
) -> Result<DiskImage, BuildError> {
    let format = probe_format(path, format)?;
    DiskImage::open(path, format, readonly).map_err(|source| BuildError::Image {
        path: path.to_path_buf(),
        source,
    })
}

/// A virtio-blk core on the image `path`, opened for `config.cache`; `config.readonly` is set
/// from `readonly`, `config.on_full` from the bounce options. Its DMA handle comes from
/// `pools` ([`PoolRegistry::dma`]) for the device `id`.
///
/// # Errors
/// Those of [`open_image`]; [`BuildError::Bounce`], [`BuildError::Device`].
pub fn block(
    path: &Path,
    format: Option<ImageFormat>,
    readonly: bool,
    mut config: BlockConfig,
    bounce: &BounceOptions,
    pools: &mut PoolRegistry,
    id: &str,
) -> Result<Built<Block<DiskImage>>, BuildError> {
    config.readonly = readonly;
    config.on_full = bounce.on_full;
    let format = probe_format(path, format)?;
    // The cache mode decides how the image is opened (O_DIRECT for none and directsync).
    let image = DiskImage::open_with(path, format, readonly, config.cache).map_err(|source| {
        BuildError::Image {
            path: path.to_path_buf(),
            source,
        }
    })?;
    let (dma, pool) = pools.dma(id, bounce, usize::from(config.num_queues))?;
    let device = Block::new(image, config, dma).map_err(|e| BuildError::Device(e.to_string()))?;
    Ok(Built { device, pool })
}

/// A virtio-net core on the tap `ifname` (one tap queue per queue pair; `None` lets the
/// kernel pick a free `tapN`, as QEMU's `-netdev tap` without `ifname=` does), its DMA
/// handle from `pools` for the device `id`. Returns the device and the tap's name.
///
/// # Errors
/// [`BuildError::Tap`], [`BuildError::Bounce`], [`BuildError::Device`].
pub fn net(
    ifname: Option<&str>,
    config: NetConfig,
    bounce: &BounceOptions,
    pools: &mut PoolRegistry,
    id: &str,
) -> Result<(Built<Net>, String), BuildError> {
    let taps = Tap::open(
        ifname.unwrap_or(Tap::KERNEL_NAMED),
        usize::from(config.queue_pairs),
    )
    .map_err(|e| BuildError::Tap(e.to_string()))?;
    let name = taps
        .first()
        .map(|t| t.name().to_string())
        .unwrap_or_default();
    let backends: Vec<Box<dyn NetBackend>> = taps
        .into_iter()
        .map(|t| Box::new(t) as Box<dyn NetBackend>)
        .collect();
    let (dma, pool) = pools.dma(id, bounce, usize::from(config.queue_pairs))?;
    let device = Net::new(config, backends, dma).map_err(|e| BuildError::Device(e.to_string()))?;
    Ok((Built { device, pool }, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qcow2_is_refused_without_format_and_raw_is_probed() {
        let dir = std::env::temp_dir();
        let q = dir.join(format!("bvm-probe-{}.qcow2", std::process::id()));
        let r = dir.join(format!("bvm-probe-{}.raw", std::process::id()));
        let mut img = QCOW2_MAGIC.to_vec();
        img.resize(4096, 0);
        std::fs::write(&q, &img).unwrap();
        std::fs::write(&r, [0u8; 4096]).unwrap();
        let e = probe_format(&q, None).unwrap_err().to_string();
        assert!(e.contains("format=qcow2"), "{e}");
        assert_eq!(
            probe_format(&q, Some(ImageFormat::Raw)).unwrap(),
            ImageFormat::Raw
        );
        assert_eq!(probe_format(&r, None).unwrap(), ImageFormat::Raw);
        // A file shorter than the magic is raw.
        std::fs::write(&r, b"QF").unwrap();
        assert_eq!(probe_format(&r, None).unwrap(), ImageFormat::Raw);
        let _ = std::fs::remove_file(&q);
        let _ = std::fs::remove_file(&r);
        assert!(matches!(
            probe_format(Path::new("/nonexistent/x"), None),
            Err(BuildError::Image { .. })
        ));
    }
}
