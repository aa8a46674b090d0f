//! `bouncevm-vhost`: bouncevm's virtio-blk and virtio-net devices served to QEMU over
//! vhost-user, with every DMA going through the bounce module.
//!
//! ```text
//! bouncevm-vhost blk --socket PATH --file IMG [--format raw|qcow2] [--readonly] [--queues N]
//!                    [--serial ID] [--no-access-platform] [--bounce OPTS] [--stats-socket PATH]
//! bouncevm-vhost net --socket PATH --tap NAME [--queues N] [--mac MAC] [--rate GBIT]
//!                    [--no-access-platform] [--bounce OPTS] [--stats-socket PATH]
//! ```
//!
//! SIGINT/SIGTERM stop the server (final statistics are printed to stderr as one JSON line);
//! SIGUSR1 prints the statistics; `--stats-socket` answers one JSON line per connection.
//! Any error is one line on stderr and a non-zero exit status.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use bounce::PoolStats;
use clap::{Args, Parser, Subcommand};
use devices::block::io::ImageFormat;
use devices::block::{Block, BlockConfig, DiskImage};
use devices::net::{Net, NetBackend, NetConfig, ShaperConfig, Tap};
use devices::virtio::VirtioDevice;
use vmm::options::BounceOptions;
use vmm::vhost::layout::{MAX_NET_QUEUE_PAIRS, MAX_QUEUES};
use vmm::vhost::{Memory, Server, SignalFd};

/// Serve bouncevm devices over vhost-user.
#[derive(Parser, Debug)]
#[command(name = "bouncevm-vhost", version, about)]
struct Cli {
    #[command(subcommand)]
    device: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// A virtio-blk device on a raw or qcow2 image (QEMU: -device vhost-user-blk-pci).
    Blk(BlkArgs),
    /// A virtio-net device on a tap interface (QEMU: -device vhost-user-net-pci,vectors=0).
    Net(NetArgs),
}

/// Options of both devices.
#[derive(Args, Debug)]
struct Common {
    /// The vhost-user socket to listen on.
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// Number of queues (blk) or queue pairs (net).
    #[arg(long, value_name = "N", default_value_t = 1)]
    queues: u16,
    /// Do not offer VIRTIO_F_ACCESS_PLATFORM (then QEMU refuses iommu_platform=on).
    #[arg(long)]
    no_access_platform: bool,
    /// Bounce buffers: policy=off|force|mask=BITS,slots=N,areas=N,alloc=NAME,mode=swiotlb|iova[,workers=N].
    #[arg(long, value_name = "OPTS")]
    bounce: Option<BounceOptions>,
    /// Also answer one JSON line of statistics to each connection on this unix socket.
    #[arg(long, value_name = "PATH")]
    stats_socket: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct BlkArgs {
    #[command(flatten)]
    common: Common,
    /// The disk image.
    #[arg(long, value_name = "IMG")]
    file: PathBuf,
    /// Image format.
    #[arg(long, default_value = "raw", value_parser = ["raw", "qcow2"])]
    format: String,
    /// Refuse writes (offers VIRTIO_BLK_F_RO).
    #[arg(long)]
    readonly: bool,
    /// The id string answered to GET_ID.
    #[arg(long, value_name = "ID", default_value = "bouncevm-blk")]
    serial: String,
}

#[derive(Args, Debug)]
struct NetArgs {
    #[command(flatten)]
    common: Common,
    /// The tap interface (created if missing, multi-queue when --queues > 1).
    #[arg(long, value_name = "NAME")]
    tap: String,
    /// The MAC address offered to the guest.
    #[arg(long, value_parser = parse_mac, default_value = "52:54:00:12:34:56")]
    mac: [u8; 6],
    /// Shape each queue pair to this line rate, in Gbit/s (e.g. 10).
    #[arg(long, value_name = "GBIT")]
    rate: Option<f64>,
}

fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    let parts: Vec<&str> = s.split(':').collect();
    let mut mac = [0u8; 6];
    if parts.len() != 6 {
        return Err(format!(
            "'{s}' is not a MAC address (six hex bytes separated by ':')"
        ));
    }
    for (b, p) in mac.iter_mut().zip(parts) {
        *b = u8::from_str_radix(p, 16).map_err(|_| format!("'{s}' is not a MAC address"))?;
    }
    Ok(mac)
}

/// The pool's statistics as JSON (null when not bouncing).
fn pool_json(stats: Option<PoolStats>) -> serde_json::Value {
    stats
        .and_then(|s| serde_json::to_value(s).ok())
        .unwrap_or(serde_json::Value::Null)
}

/// Builds, binds and runs the server for `device`, printing final statistics.
fn serve<D: VirtioDevice<Memory> + 'static>(
    name: &str,
    device: D,
    common: &Common,
    pool: Option<std::sync::Arc<bounce::BouncePool>>,
    signals: SignalFd,
) -> Result<(), String> {
    let mut server = Server::bind(name, device, &common.socket).map_err(|e| e.to_string())?;
    if let Some(p) = &common.stats_socket {
        server = server.with_stats_socket(p).map_err(|e| e.to_string())?;
    }
    let mut server = server
        .with_signals(signals)
        .with_stats_source("bounce", move || {
            pool_json(pool.as_ref().map(|p| p.stats()))
        });
    tracing::info!("{name}: listening on {}", common.socket.display());
    server.run().map_err(|e| e.to_string())?;
    eprintln!("{}", server.stats());
    Ok(())
}

fn run(cli: Cli, signals: SignalFd) -> Result<(), String> {
    match cli.device {
        Command::Blk(a) => {
            let c = &a.common;
            let format: ImageFormat = a.format.parse()?;
            let bounce = c.bounce.clone().unwrap_or_default();
            let (dma, pool) = bounce
                .build(usize::from(c.queues))
                .map_err(|e| e.to_string())?;
            let disk = DiskImage::open(&a.file, format, a.readonly)
                .map_err(|e| format!("cannot open image {}: {e}", a.file.display()))?;
            let config = BlockConfig {
                serial: a.serial.clone(),
                readonly: a.readonly,
                num_queues: c.queues,
                access_platform: !c.no_access_platform,
                ..BlockConfig::default()
            };
            let device = Block::new(disk, config, dma).map_err(|e| e.to_string())?;
            serve("bouncevm-vhost-blk", device, c, pool, signals)
        }
        Command::Net(a) => {
            let c = &a.common;
            if c.queues == 0 || c.queues > MAX_NET_QUEUE_PAIRS {
                // Checked before the tap is opened (or created).
                return Err(format!(
                    "--queues {}: net serves 1..={MAX_NET_QUEUE_PAIRS} queue pairs over vhost-user (2 vrings per pair and the control queue must fit in {MAX_QUEUES})",
                    c.queues
                ));
            }
            let bounce = c.bounce.clone().unwrap_or_default();
            let (dma, pool) = bounce
                .build(usize::from(c.queues))
                .map_err(|e| e.to_string())?;
            let taps = Tap::open(&a.tap, usize::from(c.queues))
                .map_err(|e| format!("cannot open tap {}: {e}", a.tap))?;
            let backends: Vec<Box<dyn NetBackend>> = taps
                .into_iter()
                .map(|t| Box::new(t) as Box<dyn NetBackend>)
                .collect();
            let shaper = match a.rate {
                None => None,
                Some(g) if g.is_finite() && g > 0.0 => Some(ShaperConfig {
                    // Rates are at most a few hundred Gbit/s: the product fits in u64.
                    rate_bps: (g * 1e9) as u64,
                    ..ShaperConfig::default()
                }),
                Some(g) => return Err(format!("--rate {g}: expected a positive rate in Gbit/s")),
            };
            let config = NetConfig {
                mac: a.mac,
                queue_pairs: c.queues,
                access_platform: !c.no_access_platform,
                shaper,
                ..NetConfig::default()
            };
            let device = Net::new(config, backends, dma).map_err(|e| e.to_string())?;
            serve("bouncevm-vhost-net", device, c, pool, signals)
        }
    }
}

fn main() -> ExitCode {
    // Block the signals before any thread exists, so only the signalfd sees them.
    let signals = match SignalFd::new(&[libc::SIGINT, libc::SIGTERM, libc::SIGUSR1]) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bouncevm-vhost: error: cannot set up signal handling: {e}");
            return ExitCode::FAILURE;
        }
    };
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => {
            // --help, --version
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // One line: clap's message up to its usage section, without its "error: ".
            let text = e.to_string();
            let msg: Vec<&str> = text
                .lines()
                .map(str::trim)
                .take_while(|l| !l.is_empty() && !l.starts_with("Usage:"))
                .collect();
            let msg = msg.join(" ");
            let msg = msg.strip_prefix("error: ").unwrap_or(&msg);
            eprintln!("bouncevm-vhost: error: {msg} (see --help)");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match run(cli, signals) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bouncevm-vhost: error: {e}");
            ExitCode::FAILURE
        }
    }
}
