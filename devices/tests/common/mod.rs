//! Helpers shared by the block tests: a harness that builds virtio-blk requests with the
//! test driver.
#![allow(dead_code)]

pub mod fuzz;

use bounce::Dma;
use devices::block::request::RequestHeader;
use devices::block::{Block, BlockConfig, Disk, STATUS_UNSET};
pub use devices::testing::DiskOp;
use devices::testing::{DiskHook, HookedDisk, TestDriver};
use devices::virtio::driver::Buf;
use devices::virtio::spec::{
    feature, VIRTIO_BLK_S_OK, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_RING_F_INDIRECT_DESC,
};

/// Guest RAM of every harness.
pub const RAM: u64 = 32 << 20;

/// How a request's buffers are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// header, one data descriptor, status.
    Simple,
    /// header, data split into `n` descriptors, status.
    Split(usize),
    /// everything in one indirect table (data split in 2).
    Indirect,
    /// header + data in one readable descriptor / data + status in one writable descriptor.
    Merged,
}

/// What a completed request returned.
#[derive(Debug)]
pub struct Done {
    /// Used length.
    pub len: u32,
    /// Status byte as found in guest memory.
    pub status: u8,
    /// Device-written data (for IN and GET_ID).
    pub data: Vec<u8>,
}

/// A block device under a test driver.
pub struct Blk<D: Disk> {
    pub drv: TestDriver<Block<D>>,
}

pub fn discard_seg(sector: u64, num: u32, flags: u32) -> [u8; 16] {
    let mut s = [0u8; 16];
    s[0..8].copy_from_slice(&sector.to_le_bytes());
    s[8..12].copy_from_slice(&num.to_le_bytes());
    s[12..16].copy_from_slice(&flags.to_le_bytes());
    s
}

/// Deterministic pseudo-random bytes.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

impl<D: Disk> Blk<D> {
    /// A device on `disk`, all offered features acked (minus `drop`), queues of 64 (or the
    /// device's maximum if smaller).
    pub fn new(disk: D, cfg: BlockConfig, dma: Dma, drop: u64) -> Self {
        let qsize = cfg.queue_size.min(64);
        Self::with_ring(disk, cfg, dma, drop, qsize)
    }

    /// As [`Blk::new`], with rings of `qsize` entries.
    pub fn with_ring(disk: D, cfg: BlockConfig, dma: Dma, drop: u64, qsize: u16) -> Self {
        let dev = Block::new(disk, cfg, dma).expect("device");
        let mut drv = TestDriver::new(dev, RAM);
        drv.negotiate(!drop);
        drv.activate(qsize).expect("activate");
        Self { drv }
    }

    pub fn indirect(&self) -> bool {
        self.drv.acked() & feature(VIRTIO_RING_F_INDIRECT_DESC) != 0
    }

    /// Posts a request on queue `q` and kicks; returns the completion.
    pub fn request(
        &mut self,
        q: u16,
        t: u32,
        sector: u64,
        out: &[u8],
        in_len: u32,
        layout: Layout,
    ) -> Done {
        let head = self.post(q, t, sector, out, in_len, layout);
        self.complete(q, head, in_len)
    }

    /// Posts a request without kicking; returns (head, data address, status address).
    pub fn post(
        &mut self,
        q: u16,
        t: u32,
        sector: u64,
        out: &[u8],
        in_len: u32,
        layout: Layout,
    ) -> Posted {
        let ram = &mut self.drv.ram;
        let h = RequestHeader::encode(t, sector);
        let olen = out.len() as u32;
        let mut bufs = Vec::new();
        let (din, st);
        match layout {
            Layout::Merged => {
                let mut rd = h.to_vec();
                rd.extend_from_slice(out);
                let a = ram.alloc_bytes(&rd);
                bufs.push(Buf::ro(a, rd.len() as u32));
                let w = ram.alloc(u64::from(in_len) + 1, 512);
                ram.write(w + u64::from(in_len), &[STATUS_UNSET]);
                bufs.push(Buf::wo(w, in_len + 1));
                din = w;
                st = w + u64::from(in_len);
            }
            _ => {
                let pieces = match layout {
                    Layout::Simple => 1,
                    Layout::Split(n) => n,
                    _ => 2,
                };
                bufs.push(Buf::ro(ram.alloc_bytes(&h), 16));
                if olen > 0 {
                    let a = ram.alloc_bytes(out);
                    for (off, len) in split(olen, pieces) {
                        bufs.push(Buf::ro(a + u64::from(off), len));
                    }
                }
                din = ram.alloc(u64::from(in_len).max(1), 4096);
                if in_len > 0 {
                    for (off, len) in split(in_len, pieces) {
                        bufs.push(Buf::wo(din + u64::from(off), len));
                    }
                }
                st = ram.alloc(1, 1);
                ram.write(st, &[STATUS_UNSET]);
                bufs.push(Buf::wo(st, 1));
            }
        }
        let head = if layout == Layout::Indirect {
            self.drv.post_indirect(q, &bufs)
        } else {
            self.drv.post(q, &bufs)
        }
        .expect("free descriptors");
        Posted { head, din, st }
    }

    /// Kicks `q` and returns the completion of `p` (which must be the only one pending).
    pub fn complete(&mut self, q: u16, p: Posted, in_len: u32) -> Done {
        self.drv.kick(q).expect("kick");
        let used = self.drv.wait_used(q, 1, std::time::Duration::from_secs(20));
        assert_eq!(used.len(), 1, "exactly one completion expected: {used:?}");
        assert_eq!(used[0].id, u32::from(p.head));
        self.done(p, used[0].len, in_len)
    }

    pub fn done(&self, p: Posted, len: u32, in_len: u32) -> Done {
        Done {
            len,
            status: self.drv.ram.read(p.st, 1)[0],
            data: self.drv.ram.read(p.din, in_len as usize),
        }
    }

    pub fn read(&mut self, sector: u64, len: u32, layout: Layout) -> Done {
        self.request(0, VIRTIO_BLK_T_IN, sector, &[], len, layout)
    }

    pub fn write(&mut self, sector: u64, data: &[u8], layout: Layout) -> Done {
        self.request(0, VIRTIO_BLK_T_OUT, sector, data, 0, layout)
    }

    pub fn flush(&mut self) -> u8 {
        self.request(0, VIRTIO_BLK_T_FLUSH, 0, &[], 0, Layout::Simple)
            .status
    }

    pub fn stats(&self) -> serde_json::Value {
        devices::virtio::VirtioDevice::<vm_memory::GuestMemoryMmap>::stats(&self.drv.device)
    }

    pub fn metric(&self, name: &str) -> u64 {
        self.stats()["metrics"][name].as_u64().expect("metric")
    }
}

/// What [`Blk::post`] returns.
#[derive(Clone, Copy, Debug)]
pub struct Posted {
    pub head: u16,
    pub din: u64,
    pub st: u64,
}

/// Splits `len` into `n` nearly equal (non-empty) pieces.
pub fn split(len: u32, n: usize) -> Vec<(u32, u32)> {
    let n = (n as u32).clamp(1, len.max(1));
    let base = len / n;
    let mut v = Vec::new();
    let mut off = 0;
    for i in 0..n {
        let l = if i + 1 == n { len - off } else { base };
        v.push((off, l));
        off += l;
    }
    v
}

/// Asserts a request succeeded.
pub fn ok(d: &Done) {
    assert_eq!(d.status, VIRTIO_BLK_S_OK, "request failed: {d:?}");
}

/// A [`Disk`] around another that counts every operation and what is not flushed yet, and can
/// fail the Nth operation of a kind with an errno (fault injection: EIO, ENOSPC, ...). The test
/// reaches the [`Probe`] through the device (`blk.drv.device.disk().hook`).
pub type ProbeDisk<D> = HookedDisk<D, Probe>;

/// `inner` behind a fresh [`Probe`].
pub fn probe_disk<D: Disk>(inner: D) -> ProbeDisk<D> {
    HookedDisk::new(inner, Probe::default())
}

/// The hook of a [`ProbeDisk`].
#[derive(Debug, Default)]
pub struct Probe(std::sync::Mutex<ProbeState>);

/// What a [`ProbeDisk`] saw.
#[derive(Debug, Default, Clone)]
pub struct ProbeState {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    /// Writes (and write-zeroes/discards) done since the last successful flush.
    pub unflushed: u64,
    /// Operations failed on purpose.
    pub injected: u64,
    /// (op, n, errno): fail the n-th (1-based, counted from arming) `op` with `errno`, once.
    fail: Option<(DiskOp, u64, i32)>,
    armed_at: u64,
}

impl Probe {
    pub fn state(&self) -> ProbeState {
        self.0.lock().unwrap().clone()
    }

    /// From now on, the `n`-th `op` (1-based) fails with `errno`, once.
    pub fn fail_nth(&self, op: DiskOp, n: u64, errno: i32) {
        let mut s = self.0.lock().unwrap();
        s.armed_at = match op {
            DiskOp::Read => s.reads,
            DiskOp::Write => s.writes,
            DiskOp::Flush => s.flushes,
        };
        s.fail = Some((op, n, errno));
    }

    /// Counts `op`; Err when it is the one armed to fail.
    fn count(&self, op: DiskOp) -> std::io::Result<()> {
        let mut s = self.0.lock().unwrap();
        let n = match op {
            DiskOp::Read => {
                s.reads += 1;
                s.reads
            }
            DiskOp::Write => {
                s.writes += 1;
                s.writes
            }
            DiskOp::Flush => {
                s.flushes += 1;
                s.flushes
            }
        };
        if let Some((fop, nth, errno)) = s.fail {
            if fop == op && n - s.armed_at == nth {
                s.fail = None;
                s.injected += 1;
                return Err(std::io::Error::from_raw_os_error(errno));
            }
        }
        Ok(())
    }
}

impl<D: Disk> DiskHook<D> for Probe {
    fn before(&self, op: DiskOp, _: u64, len: u64) -> std::io::Result<u64> {
        self.count(op)?;
        Ok(len)
    }

    fn after(&self, op: DiskOp, _: &D) -> std::io::Result<()> {
        let mut s = self.0.lock().unwrap();
        match op {
            DiskOp::Read => {}
            DiskOp::Write => s.unflushed += 1,
            DiskOp::Flush => s.unflushed = 0,
        }
        Ok(())
    }
}

/// `qemu-img`, or `None` after reporting it missing.
pub fn qemu_img() -> Option<&'static str> {
    bounce::testing::qemu_img_available().then_some("qemu-img")
}
