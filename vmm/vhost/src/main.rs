//! `bouncevm-vhost`: bouncevm's virtio-blk and virtio-net devices served to QEMU over
//! vhost-user, with every DMA going through the bounce module.
//!
//! ```text
//! bouncevm-vhost blk --socket PATH --file IMG [--format raw|qcow2] [--readonly] [--queues N]
//!                    [--queue-size N] [--logical-block-size N] [--serial ID]
//!                    [--aio io_uring|threads|sync]
//!                    [--cache none|writeback|writethrough|directsync|unsafe]
//!                    [--no-access-platform] [--bounce OPTS] [--stats-socket PATH]
//!                    [--socket-mode MODE] [--pidfile PATH]
//! bouncevm-vhost net --socket PATH --tap NAME [--queues N] [--queue-size N] [--mac MAC]
//!                    [--rate GBIT] [--no-access-platform] [--bounce OPTS]
//!                    [--stats-socket PATH] [--socket-mode MODE] [--pidfile PATH]
//! ```
//!
//! SIGINT/SIGTERM stop the server (final statistics are printed to stderr as one JSON line);
//! SIGUSR1 prints the statistics (a line per device); `--stats-socket` answers one JSON line
//! per connection.
//! Any error is one line on stderr and a non-zero exit status. Logs: `BOUNCEVM_LOG`.
//!
//! One process serves several devices when their command lines are joined by `--also`
//! (`bouncevm-vhost blk ... --also net ...`): each has its own socket and server thread, and
//! devices whose `--bounce` options name one `pool=NAME` share that pool. The first device's
//! server takes the signals (on SIGUSR1 every server prints its line); when any server ends,
//! the others are stopped, and each prints its final statistics line (its device's, with the
//! shared pools under `pools`).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{mpsc, Arc};

use bounce::PoolStats;
use bouncevm_common::sock;
use bouncevm_vhost::layout::{MAX_NET_QUEUE_PAIRS, MAX_QUEUES};
use bouncevm_vhost::{Memory, PrintHandle, PrintPeers, Server, SignalFd, StopHandle};
use clap::{Args, Parser, Subcommand};
use devices::block::io::{AioMode, CacheMode, ImageFormat};
use devices::block::BlockConfig;
use devices::builder;
use devices::net::{NetConfig, ShaperConfig};
use devices::options::BounceOptions;
use devices::options::{parse_mac, MAX_BLK_QUEUES};
use devices::pools::PoolRegistry;
use devices::virtio::VirtioDevice;

/// Serve bouncevm devices over vhost-user.
///
/// Several devices in one process: join their command lines with --also (`blk ... --also net
/// ...`); devices whose --bounce options name one pool=NAME share that bounce pool.
#[derive(Parser, Debug)]
#[command(name = "bouncevm-vhost", version, about)]
struct Cli {
    #[command(subcommand)]
    device: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// A virtio-blk device on a raw or qcow2 image (QEMU: -chardev socket,id=C,path=PATH
    /// -device vhost-user-blk-pci,chardev=C).
    Blk(BlkArgs),
    /// A virtio-net device on a tap interface (QEMU: -chardev socket,id=C,path=PATH -netdev
    /// vhost-user,id=N,chardev=C -device virtio-net-pci,netdev=N).
    Net(NetArgs),
}

/// Options of both devices.
#[derive(Args, Debug)]
struct Common {
    /// The vhost-user socket to listen on.
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// Permission bits of the vhost-user and statistics sockets (octal).
    #[arg(long, value_name = "MODE", default_value = "0600", value_parser = sock::parse_mode)]
    socket_mode: u32,
    /// Write this process's id to PATH once the socket accepts connections (removed on exit).
    #[arg(long, value_name = "PATH")]
    pidfile: Option<PathBuf>,
    /// Largest virtqueue size accepted from the front end (a power of two).
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = queue_size)]
    queue_size: u16,
    /// Do not offer VIRTIO_F_ACCESS_PLATFORM (then QEMU refuses iommu_platform=on).
    #[arg(long)]
    no_access_platform: bool,
    /// Bounce buffers: policy=off|force|mask=BITS,slots=N,areas=N,alloc=NAME,mode=swiotlb|iova[,workers=N][,on-full=wait|fail][,dynamic=on|off][,dynamic-slots=N][,pool=NAME]; the devices of one process (joined by --also) that name one pool=NAME share it (same pool keys).
    #[arg(long, value_name = "OPTS")]
    bounce: Option<BounceOptions>,
    /// Also answer one JSON line of statistics to each connection on this unix socket.
    #[arg(long, value_name = "PATH")]
    stats_socket: Option<PathBuf>,
}

fn queue_size(s: &str) -> Result<u16, String> {
    s.parse::<u16>()
        .ok()
        .filter(|n| n.is_power_of_two() && (2..=32768).contains(n))
        .ok_or_else(|| format!("'{s}' is not a power of two in 2..=32768"))
}

fn block_size(s: &str) -> Result<u32, String> {
    s.parse::<u32>()
        .ok()
        .filter(|n| n.is_power_of_two() && (512..=65536).contains(n))
        .ok_or_else(|| format!("'{s}' is not a power of two in 512..=65536"))
}

/// The default `--queues` of `blk`: one per host CPU (at most 64). QEMU's
/// vhost-user-blk-pci asks for one queue per guest vCPU unless `num-queues=` says otherwise,
/// and refuses a backend that offers fewer; guests rarely have more vCPUs than the host has
/// CPUs. Linux uses at most one queue per vCPU, so unused queues cost nothing.
fn default_blk_queues() -> u16 {
    std::thread::available_parallelism()
        .map(|n| n.get().min(usize::from(MAX_BLK_QUEUES)) as u16)
        .unwrap_or(1)
}

#[derive(Args, Debug)]
struct BlkArgs {
    #[command(flatten)]
    common: Common,
    /// The disk image.
    #[arg(long, value_name = "IMG")]
    file: PathBuf,
    /// Image format; without it a qcow2 image is refused (name the format to use one).
    #[arg(long, value_parser = ["raw", "qcow2"])]
    format: Option<String>,
    /// Refuse writes (offers VIRTIO_BLK_F_RO).
    #[arg(long)]
    readonly: bool,
    /// Number of request queues [default: one per host CPU, at most 64; QEMU asks for one
    /// per guest vCPU unless the device says num-queues=].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=64))]
    queues: Option<u16>,
    /// Logical block size reported to the guest (blk_size; a power of two).
    #[arg(long, value_name = "BYTES", default_value_t = 512, value_parser = block_size)]
    logical_block_size: u32,
    /// The id string answered to GET_ID.
    #[arg(long, value_name = "ID", default_value = "bouncevm-blk")]
    serial: String,
    /// Host I/O engine, as QEMU's aio= [default: io_uring for raw images, threads for qcow2].
    #[arg(long, value_name = "MODE")]
    aio: Option<AioMode>,
    /// Host cache mode, as QEMU's cache= (none and directsync open the image with O_DIRECT).
    #[arg(long, value_name = "MODE", default_value = "writeback")]
    cache: CacheMode,
}

#[derive(Args, Debug)]
struct NetArgs {
    #[command(flatten)]
    common: Common,
    /// The tap interface (created if missing, multi-queue when --queues > 1).
    #[arg(long, value_name = "NAME")]
    tap: String,
    /// Number of queue pairs (QEMU: -netdev vhost-user,queues=N; its default is 1). 1..=31: two vrings a pair and the control queue must fit in 64.
    #[arg(long, value_name = "N", default_value_t = 1)]
    queues: u16,
    /// The MAC address in the device's config space. QEMU's virtio-net-pci does not read it:
    /// the guest sees the MAC of QEMU's own -device (mac=, or QEMU's default); only a front
    /// end that reads the backend's config space sees this one.
    #[arg(long, value_parser = parse_mac, default_value = "52:54:00:12:34:56")]
    mac: [u8; 6],
    /// Shape each queue pair to this line rate, in Gbit/s (e.g. 10).
    #[arg(long, value_name = "GBIT")]
    rate: Option<f64>,
}

/// The pool's statistics as JSON (null when not bouncing).
fn pool_json(stats: Option<PoolStats>) -> serde_json::Value {
    stats
        .and_then(|s| serde_json::to_value(s).ok())
        .unwrap_or(serde_json::Value::Null)
}

/// A pid file, written atomically and removed on drop.
struct PidFile(PathBuf);

impl PidFile {
    fn write(path: &Path) -> Result<Self, String> {
        let err = |e: std::io::Error| format!("--pidfile {}: {e}", path.display());
        let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
        std::fs::write(&tmp, format!("{}\n", std::process::id())).map_err(err)?;
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            err(e)
        })?;
        Ok(Self(path.to_path_buf()))
    }
}

impl Drop for PidFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The token that joins the command lines of the devices one process serves.
const ALSO: &str = "--also";

/// A built device and the command line it came from.
struct Prepared {
    name: &'static str,
    common: Common,
    device: Device,
}

enum Device {
    Blk(builder::Built<devices::block::Block<devices::block::DiskImage>>),
    Net(builder::Built<devices::net::Net>),
}

/// A bound server: what stops it, what makes it print its statistics, and what runs it
/// (serves until stopped, then prints the final statistics).
struct Bound {
    stop: StopHandle,
    print: PrintHandle,
    run: Box<dyn FnOnce() -> Result<(), String> + Send>,
}

/// Binds the server for `device` (with the signals when given, and `peers` to print along on
/// SIGUSR1); its sockets accept connections from here on.
fn bind<D: VirtioDevice<Memory> + Send + 'static>(
    name: &str,
    built: builder::Built<D>,
    common: &Common,
    signals: Option<SignalFd>,
    peers: &PrintPeers,
    pools: &Arc<PoolRegistry>,
) -> Result<Bound, String> {
    let mode = common.socket_mode;
    let mut server =
        Server::bind_mode(name, built.device, &common.socket, mode).map_err(|e| e.to_string())?;
    if let Some(p) = &common.stats_socket {
        server = server
            .with_stats_socket_mode(p, mode)
            .map_err(|e| e.to_string())?;
    }
    if let Some(s) = signals {
        server = server.with_signals(s).with_print_peers(Arc::clone(peers));
    }
    let pool = built.pool;
    let reset_pool = pool.clone();
    let shared = common.bounce.as_ref().and_then(|b| b.pool.clone());
    let mut server = server
        .with_reset(move || {
            if let Some(p) = &reset_pool {
                p.reset_hiwater();
            }
        })
        .with_stats_source("bounce", move || match &shared {
            // A shared pool is listed once under `pools`.
            Some(name) => serde_json::json!({ "pool": name }),
            None => pool_json(pool.as_ref().map(|p| p.stats())),
        });
    if !pools.names().is_empty() {
        let pools = Arc::clone(pools);
        server = server.with_stats_source("pools", move || pools.pools_json());
    }
    let stop = server.stop_handle().map_err(|e| e.to_string())?;
    let print = server.print_handle().map_err(|e| e.to_string())?;
    let name = name.to_string();
    let socket = common.socket.clone();
    let run = Box::new(move || {
        tracing::info!("{name}: listening on {}", socket.display());
        server.run().map_err(|e| e.to_string())?;
        eprintln!("{}", server.stats());
        Ok(())
    });
    Ok(Bound { stop, print, run })
}

/// Builds the device of one command line, its DMA from `pools` (the device id is its socket).
fn build(cli: Cli, pools: &mut PoolRegistry) -> Result<Prepared, String> {
    match cli.device {
        Command::Blk(a) => {
            let c = &a.common;
            let format: Option<ImageFormat> = a.format.as_deref().map(str::parse).transpose()?;
            let config = BlockConfig {
                serial: a.serial.clone(),
                num_queues: a.queues.unwrap_or_else(default_blk_queues),
                queue_size: c.queue_size,
                blk_size: a.logical_block_size,
                access_platform: !c.no_access_platform,
                aio: a.aio,
                cache: a.cache,
                ..BlockConfig::default()
            };
            let bounce = c.bounce.clone().unwrap_or_else(BounceOptions::off);
            let id = c.socket.display().to_string();
            let built = builder::block(&a.file, format, a.readonly, config, &bounce, pools, &id)
                .map_err(|e| format!("--file: {e}"))?;
            Ok(Prepared {
                name: "bouncevm-vhost-blk",
                common: a.common,
                device: Device::Blk(built),
            })
        }
        Command::Net(a) => {
            let c = &a.common;
            if a.queues == 0 || a.queues > MAX_NET_QUEUE_PAIRS {
                // Checked before the tap is opened (or created).
                return Err(format!(
                    "--queues {}: net serves 1..={MAX_NET_QUEUE_PAIRS} queue pairs over vhost-user (2 vrings per pair and the control queue must fit in {MAX_QUEUES})",
                    a.queues
                ));
            }
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
                queue_pairs: a.queues,
                queue_size: c.queue_size,
                access_platform: !c.no_access_platform,
                shaper,
                // QEMU keeps the control queue and steers the pairs with SET_VRING_ENABLE.
                frontend_steering: true,
            };
            let bounce = c.bounce.clone().unwrap_or_else(BounceOptions::off);
            let id = c.socket.display().to_string();
            let (built, _) = builder::net(Some(&a.tap), config, &bounce, pools, &id)
                .map_err(|e| format!("--tap {}: {e}", a.tap))?;
            Ok(Prepared {
                name: "bouncevm-vhost-net",
                common: a.common,
                device: Device::Net(built),
            })
        }
    }
}

/// Builds every device and binds its server, then serves each on its own thread until one
/// server ends (a signal to the first, or an error), then stops the others.
fn run(clis: Vec<Cli>, signals: SignalFd) -> Result<(), String> {
    let mut pools = PoolRegistry::default();
    let prepared = clis
        .into_iter()
        .map(|c| build(c, &mut pools))
        .collect::<Result<Vec<_>, _>>()?;
    let pools = Arc::new(pools);
    let mut signals = Some(signals);
    let peers = PrintPeers::default();
    let mut bound = Vec::new();
    let mut pids = Vec::new();
    for p in prepared {
        let s = signals.take();
        bound.push(match p.device {
            Device::Blk(b) => bind(p.name, b, &p.common, s, &peers, &pools)?,
            Device::Net(n) => bind(p.name, n, &p.common, s, &peers, &pools)?,
        });
        // The socket (and the stats socket) accept connections from here on.
        if let Some(path) = p.common.pidfile.as_deref() {
            pids.push(PidFile::write(path)?);
        }
    }
    let (done_tx, done) = mpsc::channel();
    let mut stops = Vec::new();
    let mut threads = Vec::new();
    for (i, b) in bound.into_iter().enumerate() {
        stops.push(b.stop);
        if i > 0 {
            peers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(b.print);
        }
        let (run, done_tx) = (b.run, done_tx.clone());
        let t = std::thread::Builder::new()
            .name(format!("serve-{i}"))
            .spawn(move || {
                let r = run();
                let _ = done_tx.send(i);
                r
            });
        match t {
            Ok(t) => threads.push(t),
            Err(e) => {
                stops.iter().for_each(StopHandle::stop);
                return Err(format!("cannot start a server thread: {e}"));
            }
        }
    }
    let _ = done.recv();
    stops.iter().for_each(StopHandle::stop);
    let mut result = Ok(());
    for t in threads {
        let ended = t
            .join()
            .unwrap_or_else(|_| Err("a server thread panicked".into()));
        result = result.and(ended);
    }
    drop(pids);
    result
}

/// The command lines of the devices: the arguments split at each `--also`.
fn device_args() -> Vec<Vec<OsString>> {
    let mut args = std::env::args_os();
    let prog = args.next().unwrap_or_else(|| "bouncevm-vhost".into());
    let mut out = vec![vec![prog.clone()]];
    for a in args {
        if a == ALSO {
            out.push(vec![prog.clone()]);
        } else if let Some(last) = out.last_mut() {
            last.push(a);
        }
    }
    out
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
    let mut clis = Vec::new();
    for args in device_args() {
        match bouncevm_common::cli::parse_args_from::<Cli, _>(
            "bouncevm-vhost",
            " (see --help)",
            args,
        ) {
            Ok(c) => clis.push(c),
            Err(code) => return code,
        }
    }
    bouncevm_common::init_logging("info");
    match run(clis, signals) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bouncevm-vhost: error: {e}");
            ExitCode::FAILURE
        }
    }
}
