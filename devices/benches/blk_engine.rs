//! Block engines side by side through the device core: 4 KiB random reads at a constant depth
//! of 32 (a completed request is re-posted at once), `aio=sync` against `aio=io_uring` and
//! `aio=threads`, on a file on tmpfs (`/dev/shm`) and on the root file system, both with
//! `cache=none` (O_DIRECT; this kernel's tmpfs accepts it), bounce off and forced swiotlb.
//!
//! `cargo bench -p devices --bench blk_engine -- [--rounds N] [--secs S] [--dirs A,B]`
//!
//! Rounds are interleaved (every configuration once per round, in turn), each run `S` seconds;
//! the summary gives the median, min and max of requests/s over the rounds and the ratio to
//! `sync` in the same round. Times include the test driver's side (descriptors, avail ring,
//! used ring, polling the engine's eventfd).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bounce::{BouncePool, Dma, Policy, PoolConfig};
use devices::block::io::{AioMode, CacheMode, RawDisk};
use devices::block::request::RequestHeader;
use devices::block::{Block, BlockConfig};
use devices::testing::TestDriver;
use devices::virtio::driver::Buf;
use devices::virtio::spec::VIRTIO_BLK_T_IN;

const DEPTH: usize = 32;
const FILE: u64 = 256 << 20;

struct Rig {
    drv: TestDriver<Block<RawDisk>>,
    slots: Vec<(u64, u64, u64)>,
    head_slot: Vec<usize>,
    rng: u64,
}

impl Rig {
    fn new(path: &Path, aio: AioMode, dma: Dma) -> Self {
        let disk = RawDisk::open_with(path, true, CacheMode::None).expect("open with O_DIRECT");
        let cfg = BlockConfig {
            aio: Some(aio),
            cache: CacheMode::None,
            readonly: true,
            ..BlockConfig::default()
        };
        let mut drv = TestDriver::new(Block::new(disk, cfg, dma).unwrap(), 64 << 20);
        drv.negotiate(u64::MAX);
        drv.activate(256).unwrap();
        let slots = (0..DEPTH)
            .map(|_| {
                let h = drv.ram.alloc(16, 16);
                let d = drv.ram.alloc(4096, 4096);
                let s = drv.ram.alloc(1, 1);
                (h, d, s)
            })
            .collect();
        Self {
            drv,
            slots,
            head_slot: vec![usize::MAX; 256],
            rng: 0x9e37_79b9_7f4a_7c15,
        }
    }

    fn post(&mut self, slot: usize) {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let sector = (self.rng % (FILE / 4096)) * 8;
        let (h, d, s) = self.slots[slot];
        self.drv
            .ram
            .write(h, &RequestHeader::encode(VIRTIO_BLK_T_IN, sector));
        let head = self
            .drv
            .post(0, &[Buf::ro(h, 16), Buf::wo(d, 4096), Buf::wo(s, 1)])
            .expect("descriptors");
        self.head_slot[usize::from(head)] = slot;
    }

    /// Runs for `secs` at constant depth; returns requests completed per second.
    fn run(&mut self, secs: f64) -> f64 {
        for s in 0..DEPTH {
            self.post(s);
        }
        self.drv.kick(0).unwrap();
        let start = Instant::now();
        let until = start + Duration::from_secs_f64(secs);
        let mut done = 0u64;
        let mut draining = false;
        let mut inflight = DEPTH;
        loop {
            let used = self.drv.reap(0);
            inflight -= used.len();
            done += used.len() as u64;
            if Instant::now() >= until {
                draining = true;
            }
            if !draining {
                for u in &used {
                    let slot = self.head_slot[u.id as usize];
                    self.post(slot);
                    inflight += 1;
                }
                if !used.is_empty() {
                    self.drv.kick(0).unwrap();
                }
            }
            if inflight == 0 {
                break;
            }
            if !used.is_empty() {
                // Progress: look at the ring again before sleeping on the engine's fd.
                continue;
            }
            let n = self.drv.poll_worker(0, 5000).unwrap();
            assert!(n > 0, "no completion within 5 s");
        }
        done as f64 / start.elapsed().as_secs_f64()
    }
}

fn fill(path: &Path) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    let chunk: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8).collect();
    for _ in 0..(FILE >> 20) {
        f.write_all(&chunk).unwrap();
    }
    f.sync_all().unwrap();
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() {
    let mut rounds = 5usize;
    let mut secs = 1.0f64;
    let mut dirs = vec![PathBuf::from("/dev/shm"), std::env::temp_dir()];
    let args: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < args.len() {
        match args[i].as_str() {
            "--rounds" => {
                rounds = args[i + 1].parse().expect("--rounds N");
                i += 1;
            }
            "--secs" => {
                secs = args[i + 1].parse().expect("--secs S");
                i += 1;
            }
            "--dirs" => {
                dirs = args[i + 1].split(',').map(PathBuf::from).collect();
                i += 1;
            }
            // cargo bench passes --bench; criterion-style filters are ignored.
            _ => {}
        }
        i += 1;
    }
    let pool = Arc::new(BouncePool::new(&PoolConfig::swiotlb(32768)).unwrap());
    let dmas = [
        ("off", Dma::direct()),
        ("force-swiotlb", Dma::bounced(Policy::Force, pool)),
    ];
    let aios = [AioMode::Sync, AioMode::IoUring, AioMode::Threads];
    let mut files = Vec::new();
    for d in &dirs {
        let p = d.join(format!("bouncevm-blk-engine-{}.raw", std::process::id()));
        fill(&p);
        files.push(p);
    }
    // (file, dma, aio) -> samples
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); files.len() * dmas.len() * aios.len()];
    for r in 0..rounds {
        let mut k = 0;
        for f in &files {
            for (_, dma) in &dmas {
                for aio in aios {
                    let mut rig = Rig::new(f, aio, dma.clone());
                    samples[k].push(rig.run(secs));
                    k += 1;
                }
            }
        }
        eprintln!("round {}/{rounds} done", r + 1);
    }
    println!(
        "4 KiB randread, depth {DEPTH}, cache=none, {rounds} interleaved rounds of {secs} s; requests/s median [min, max]; ratio to sync (median of per-round ratios)"
    );
    let mut k = 0;
    for f in &files {
        for (dname, _) in &dmas {
            let base = samples[k].clone();
            for aio in aios {
                let s = &samples[k];
                let mut v = s.clone();
                let mut ratios: Vec<f64> = s.iter().zip(&base).map(|(a, b)| a / b).collect();
                let (lo, hi) = v
                    .iter()
                    .fold((f64::MAX, 0f64), |(l, h), &x| (l.min(x), h.max(x)));
                println!(
                    "{:<14} {:<14} {:<9} {:>9.0} [{:>9.0}, {:>9.0}]  x{:.2} [{:.2}, {:.2}]",
                    f.parent().unwrap().display(),
                    dname,
                    aio.name(),
                    median(&mut v),
                    lo,
                    hi,
                    median(&mut ratios),
                    ratios.iter().cloned().fold(f64::MAX, f64::min),
                    ratios.iter().cloned().fold(0f64, f64::max),
                );
                k += 1;
            }
        }
    }
    for f in &files {
        let _ = std::fs::remove_file(f);
    }
}
