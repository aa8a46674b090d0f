//! qcow2 images through `imago` (sync mode), compatible with `qemu-img`.
//!
//! # Crash consistency
//! QEMU keeps a qcow2 image consistent across a crash of its process: a cluster's refcount
//! reaches the file before anything references the cluster, so a crash can leak clusters but
//! never leave a reference to a cluster with refcount 0 (which a later allocation would hand
//! out again, overwriting live data). `imago` 0.2 orders its refcount and L2 caches that way,
//! but enters a new L2 table into the L1 table (and a new L1 table into the header) with a
//! direct write while the new cluster's refcount is still only in its refcount cache: a
//! SIGKILL before the next flush left `qemu-img check` reporting corruption. [`OrderedFile`]
//! holds those writes back until the flush that follows the caches' write-back, which is
//! QEMU's order (refcounts, then L2 tables, then L1 entries). It also holds back the refcount
//! table entry of a new refcount block placed in a freed cluster until that cluster's own
//! refcount is in the file (imago writes the entry first).

use std::fmt;
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use imago::file::File as ImagoFile;
use imago::format::gate::ImplicitOpenGate;
use imago::io_buffers::{IoBuffer, IoVector, IoVectorMut};
use imago::qcow2::Qcow2;
use imago::storage::drivers::CommonStorageHelper;
use imago::storage::PreallocateMode;
use imago::{FormatAccess, FormatDriverBuilder, Storage, StorageOpenOptions};
use vm_memory::bitmap::BitmapSlice;
use vm_memory::VolatileSlice;

use super::{CacheMode, Disk};
use crate::block::SECTOR_SIZE;

// Plain fields and a hand-written Debug; alike in shape only to other small structs.
/// A qcow2 image.
///
/// Reads, writes and write-zeroes without unmapping share the image (`imago` serialises what
/// needs it internally); discards take it exclusively, because `imago` requires that no data
/// mapping is in use while clusters are freed.
pub struct Qcow2Disk {
    image: RwLock<FormatAccess<OrderedFile>>,
    capacity: u64,
    readonly: bool,
}

impl std::fmt::Debug for Qcow2Disk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qcow2Disk")
            .field("capacity", &self.capacity)
            .field("readonly", &self.readonly)
            .finish_non_exhaustive()
    }
}

fn poisoned() -> io::Error {
    io::Error::other("qcow2 image lock poisoned")
}

impl Qcow2Disk {
    /// Opens a qcow2 image (and, as qemu does, the backing files it names).
    ///
    /// # Errors
    /// The open error (not a qcow2 image, unsupported features, ...).
    pub fn open(path: &Path, readonly: bool) -> io::Result<Self> {
        Self::open_with(path, readonly, CacheMode::Writeback)
    }

    /// Opens a qcow2 image for `cache`: with O_DIRECT for `none` and `directsync` (the image
    /// and its backing files; `imago` aligns buffers and requests for direct I/O itself).
    ///
    /// # Errors
    /// As [`Qcow2Disk::open`]; a file system without direct I/O gets the one-line
    /// [`super::raw::direct_io_refused`] error.
    pub fn open_with(path: &Path, readonly: bool, cache: CacheMode) -> io::Result<Self> {
        check_header(path)?;
        let qcow2 = Qcow2::<OrderedFile>::builder_path(path)
            .storage_open_options(StorageOpenOptions::new().direct(cache.direct()))
            .write(!readonly)
            .open(BoundedGate::default())
            .map_err(|e| {
                if cache.direct() && e.raw_os_error() == Some(libc::EINVAL) {
                    super::raw::direct_io_refused(path, cache, &e)
                } else {
                    e
                }
            })?;
        let image = FormatAccess::new(qcow2);
        let size = image.size();
        Ok(Self {
            image: RwLock::new(image),
            capacity: size - size % SECTOR_SIZE,
            readonly,
        })
    }

    fn shared(&self) -> io::Result<RwLockReadGuard<'_, FormatAccess<OrderedFile>>> {
        self.image.read().map_err(|_| poisoned())
    }

    fn exclusive(&self) -> io::Result<RwLockWriteGuard<'_, FormatAccess<OrderedFile>>> {
        self.image.write().map_err(|_| poisoned())
    }

    fn check_writable(&self) -> io::Result<()> {
        if self.readonly {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "read-only disk",
            ));
        }
        Ok(())
    }
}

/// The deepest backing chain opened.
const MAX_BACKING_DEPTH: usize = 32;

/// `imago`'s permissive gate (backing files open as the image names them) with a bound on
/// the chain: an image that names itself, or any loop, recursed until the stack overflowed
/// (found by `tests/qcow2_fuzz.rs`).
#[derive(Clone, Copy, Debug, Default)]
struct BoundedGate {
    depth: usize,
}

impl<S: Storage + 'static> ImplicitOpenGate<S> for BoundedGate {
    fn open_format<F: FormatDriverBuilder<S>>(
        &mut self,
        builder: F,
    ) -> io::Result<FormatAccess<S>> {
        if self.depth >= MAX_BACKING_DEPTH {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("backing chain deeper than {MAX_BACKING_DEPTH} images (a loop?)"),
            ));
        }
        let inner = builder.open(BoundedGate {
            depth: self.depth + 1,
        })?;
        Ok(FormatAccess::new(inner))
    }

    fn open_storage(&mut self, builder: StorageOpenOptions) -> io::Result<S> {
        S::open(builder)
    }
}

/// Refuses what `imago` accepts but cannot serve: refcount structures that do not count the
/// header cluster (no refcount table, `refcount_table_clusters` 0, a table past the end of the
/// file, no refcount block for cluster 0, or a refcount of 0 for it). Such an image is corrupt
/// (`qemu-img check` says so), and imago's first cluster allocation on it recursed until the
/// stack overflowed, killing the process (found by `tests/qcow2_fuzz.rs`). A file too short
/// for the header is left to imago's own checks.
fn check_header(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path)?;
    let mut h = [0u8; 100];
    if f.read_exact_at(&mut h, 0).is_err() || h[0..4] != *b"QFI\xfb" {
        return Ok(());
    }
    let be32 = |o: usize| u32::from_be_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
    let corrupt = |why: &str| {
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: corrupt qcow2 image: {why}", path.display()),
        ))
    };
    if be32(56) == 0 {
        return corrupt("it does not contain a reference count table");
    }
    let mut e = [0u8; 8];
    if f.read_exact_at(&mut e, be_u64(&h[48..56])).is_err() {
        return corrupt("the reference count table lies outside the file");
    }
    let rb = be_u64(&e) & 0x00ff_ffff_ffff_fe00;
    // v2 images have 16-bit refcounts; v3 name the order (imago checks its range).
    let order = if be32(4) >= 3 { be32(96).min(6) } else { 4 };
    let bits = 1u32 << order;
    let mut first = [0u8; 8];
    let n = (bits as usize).div_ceil(8);
    if rb == 0 || f.read_exact_at(&mut first[..n], rb).is_err() {
        return corrupt("no refcount block covers the header");
    }
    let refcount = if bits < 8 {
        u64::from(first[0] & ((1u8 << bits) - 1))
    } else {
        be_u64(&first[..n])
    };
    if refcount == 0 {
        return corrupt("the header cluster has a refcount of 0");
    }
    Ok(())
}

// Same `Disk` method list as MemDisk and RawDisk; each serves its own backing store.
impl Disk for Qcow2Disk {
    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn read_at<B: BitmapSlice>(
        &self,
        offset: u64,
        buf: &mut VolatileSlice<B>,
    ) -> io::Result<usize> {
        let len = buf.len();
        let slice: &VolatileSlice<B> = buf;
        // The guard keeps the memory behind the vector mapped while imago uses it.
        let (vec, _guard) = IoVectorMut::from_volatile_slice_one(slice);
        self.shared()?.readv(vec, offset)?;
        Ok(len)
    }

    fn write_at<B: BitmapSlice>(&self, offset: u64, buf: &VolatileSlice<B>) -> io::Result<usize> {
        self.check_writable()?;
        let (vec, _guard) = IoVector::from_volatile_slice_one(buf);
        self.shared()?.writev(vec, offset)?;
        Ok(buf.len())
    }

    fn flush(&self) -> io::Result<()> {
        if self.readonly {
            return Ok(());
        }
        // Exclusive: no request may allocate (and hold back an L1 write) between the write-back
        // of the refcount cache and the release of the held-back writes (see [`OrderedFile`]).
        let image = self.exclusive()?;
        // Write out imago's metadata caches (refcounts, L2 tables, then the held-back L1 and
        // header writes), then make data and metadata durable.
        image.flush()?;
        image.sync()
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_writable()?;
        match self.exclusive()?.discard_to_any(offset, len) {
            // Discard is a hint.
            Err(e) if e.kind() == io::ErrorKind::Unsupported => Ok(()),
            r => r,
        }
    }

    fn write_zeroes(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        self.check_writable()?;
        if unmap {
            self.exclusive()?.discard_to_zero(offset, len)
        } else {
            self.shared()?.write_zeroes(offset, len)
        }
    }

    fn kind(&self) -> &'static str {
        "qcow2"
    }
}

/// How long [`OrderedFile`] holds a write back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Until {
    /// The next [`Storage::flush`] (L1 table and header writes).
    Flush,
    /// The refcount block every new entry of this refcount table write points to is counted
    /// in the file (its own cluster has a non-zero refcount there), or the next flush.
    Refcounted,
}

/// One held-back write.
#[derive(Debug)]
struct HeldWrite {
    off: u64,
    data: Vec<u8>,
    until: Until,
}

impl HeldWrite {
    fn range(&self) -> Range<u64> {
        self.off..self.off + self.data.len() as u64
    }
}

/// What [`OrderedFile`] holds back.
#[derive(Debug, Default)]
struct Held {
    /// The image header's first bytes as `imago` last wrote them (held-back writes applied).
    header: Vec<u8>,
    /// The header cluster.
    header_range: Range<u64>,
    /// The L1 table, as the header places it.
    l1: Range<u64>,
    /// The refcount table, as the header places it.
    reftable: Range<u64>,
    /// log2 of the cluster size.
    cluster_bits: u32,
    /// log2 of the refcount width in bits.
    refcount_order: u32,
    /// Held-back writes, in the order `imago` made them.
    writes: Vec<HeldWrite>,
}

/// Bytes of the header [`Held`] parses: up to the refcount order (a v3 field).
const HEADER_PARSED: usize = 100;

/// The refcount table's offset and size in clusters in the header.
const REFTABLE_POINTER: Range<usize> = 48..60;

/// The refcount block offset in a refcount table entry.
const REFTABLE_OFFSET_MASK: u64 = 0xffff_ffff_ffff_fe00;

fn overlaps(a: &Range<u64>, off: u64, len: u64) -> bool {
    off < a.end && a.start < off.saturating_add(len)
}

impl Held {
    /// Re-reads the header cluster and the L1 and refcount tables' places from `header`.
    fn parse(&mut self) {
        let h = &self.header;
        if h.len() < HEADER_PARSED || h[..4] != *b"QFI\xfb" {
            self.header_range = 0..0;
            self.l1 = 0..0;
            self.reftable = 0..0;
            return;
        }
        let be32 = |at: usize| u32::from_be_bytes(h[at..at + 4].try_into().unwrap_or([0; 4]));
        let be64 = |at: usize| u64::from_be_bytes(h[at..at + 8].try_into().unwrap_or([0; 8]));
        self.cluster_bits = be32(20).min(31);
        let cluster = 1u64 << self.cluster_bits;
        let l1_start = be64(40);
        self.header_range = 0..cluster;
        self.l1 = l1_start..l1_start.saturating_add(8 * u64::from(be32(36)));
        let rt_start = be64(48);
        self.reftable = rt_start..rt_start.saturating_add(u64::from(be32(56)) << self.cluster_bits);
        // v2 images have 16-bit refcounts; v3 name the order (imago refuses more than 6).
        self.refcount_order = if be32(4) >= 3 { be32(96).min(6) } else { 4 };
    }

    /// Until when a write of `len` bytes at `off` must wait, if it must.
    fn holds(&self, off: u64, len: u64) -> Option<Until> {
        if overlaps(&self.header_range, off, len) || overlaps(&self.l1, off, len) {
            Some(Until::Flush)
        } else if overlaps(&self.reftable, off, len) {
            Some(Until::Refcounted)
        } else {
            None
        }
    }

    /// Whether `len` bytes at `off` overlap a held-back write.
    fn touches(&self, off: u64, len: u64) -> bool {
        self.writes.iter().any(|w| overlaps(&w.range(), off, len))
    }

    /// Copies `data` (at `off`) over the bytes it covers in held-back writes and the header.
    fn overlay(&mut self, off: u64, data: &[u8]) {
        for w in &mut self.writes {
            copy_overlap(w.off, &mut w.data, off, data);
        }
        copy_overlap(0, &mut self.header, off, data);
    }

    /// Applies held-back writes to `buf`, just read at `off`.
    fn apply(&self, off: u64, buf: &mut [u8]) {
        for w in &self.writes {
            copy_overlap(off, buf, w.off, &w.data);
        }
    }
}

/// Copies the part of `src` (at `src_off`) that overlaps `dst` (at `dst_off`) into `dst`.
fn copy_overlap(dst_off: u64, dst: &mut [u8], src_off: u64, src: &[u8]) {
    let start = dst_off.max(src_off);
    let end = (dst_off + dst.len() as u64).min(src_off + src.len() as u64);
    if start >= end {
        return;
    }
    let (Ok(d), Ok(s), Ok(n)) = (
        usize::try_from(start - dst_off),
        usize::try_from(start - src_off),
        usize::try_from(end - start),
    ) else {
        return;
    };
    dst[d..d + n].copy_from_slice(&src[s..s + n]);
}

/// An image file that holds back `imago`'s writes of the header cluster and the L1 table
/// until the next [`Storage::flush`], which `imago` calls after writing back its refcount and
/// L2 caches (see the module documentation). Reads see the held-back bytes; a crash before
/// the flush leaves the previous, consistent L1 table and header, and at most leaked clusters.
///
/// It also holds back a refcount table write that enters a new refcount block until that
/// block's own cluster is counted in the file: `imago` writes the entry at once, but when the
/// block lands in a freed cluster (after a discard, or a freed old table) that cluster's
/// refcount is still 0 in the file until the refcount cache is written back, and a refcount
/// block with refcount 0 is corruption, not a leak. Such a write goes to the file as soon as
/// a later write makes its condition true (the refcount cache's write-back, which `imago`
/// also does before it writes any L2 table that could reference a cluster the new block
/// counts), and at the latest at the next flush.
#[derive(Debug)]
pub struct OrderedFile {
    inner: ImagoFile,
    held: Mutex<Held>,
}

impl fmt::Display for OrderedFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl OrderedFile {
    fn held(&self) -> io::Result<std::sync::MutexGuard<'_, Held>> {
        self.held.lock().map_err(|_| poisoned())
    }

    /// An aligned buffer of `len` bytes for the inner file (O_DIRECT).
    fn buffer(&self, len: usize) -> io::Result<IoBuffer> {
        IoBuffer::new(len, self.inner.mem_align().max(1))
    }

    /// The block size of direct reads and writes of our own.
    fn block(&self) -> usize {
        self.inner.mem_align().max(self.inner.req_align()).max(512)
    }

    /// `len` bytes at `off` as the file holds them (held-back writes not applied).
    fn read_file(&self, off: u64, len: usize) -> io::Result<Vec<u8>> {
        let block = self.block() as u64;
        let start = off - off % block;
        let end = off
            .checked_add(len as u64)
            .and_then(|e| e.checked_next_multiple_of(block))
            .ok_or_else(|| io::Error::other("qcow2 metadata offset overflow"))?;
        let mut buf = self.buffer(usize::try_from(end - start).map_err(io::Error::other)?)?;
        // SAFETY: an aligned request into a buffer aligned for this file.
        unsafe { self.inner.pure_readv(IoVectorMut::from(&mut buf), start) }?;
        let skip = usize::try_from(off - start).map_err(io::Error::other)?;
        Ok(buf.as_ref().into_slice()[skip..skip + len].to_vec())
    }

    /// Writes `data` at `off` to the file.
    fn write_file(&self, off: u64, data: &[u8]) -> io::Result<()> {
        let mut buf = self.buffer(data.len())?;
        buf.as_mut().into_slice().copy_from_slice(data);
        // SAFETY: `pure_writev` requires aligned requests; these are `imago`'s own
        // requests, aligned by its storage layer for this file, replayed unchanged, or one
        // aligned block of ours.
        unsafe { self.inner.pure_writev(IoVector::from(&buf), off) }?;
        wrote();
        Ok(())
    }

    /// Writes the refcount table pointer of the header `imago` last wrote to the file now, if
    /// it moved: `imago` writes a grown refcount table and flushes the refcounts that cover it
    /// before it points the header there, then frees the old table, which the next allocation
    /// may overwrite, so the file's header must not keep pointing at it until the next flush.
    /// The rest of the header (the L1 table pointer, the size) still waits for the flush.
    fn write_reftable_pointer(&self, held: &Held) -> io::Result<()> {
        let Some(pointer) = held.header.get(REFTABLE_POINTER) else {
            return Ok(());
        };
        let mut block = self.read_file(0, self.block())?;
        if block[REFTABLE_POINTER] == *pointer {
            return Ok(());
        }
        block[REFTABLE_POINTER].copy_from_slice(pointer);
        self.write_file(0, &block)
    }

    /// Writes every held-back write, in order; what fails stays held.
    fn release(&self, held: &mut Held) -> io::Result<()> {
        while let Some(w) = held.writes.first() {
            self.write_file(w.off, &w.data)?;
            held.writes.remove(0);
        }
        Ok(())
    }

    /// Writes the refcount table writes whose condition now holds, repeatedly (one may make
    /// another's true); drops those outside the refcount table (it moved: `imago` wrote the
    /// new one whole, after its refcounts, and frees the old one).
    fn settle(&self, held: &mut Held) -> io::Result<()> {
        loop {
            let mut ready = None;
            for (i, w) in held.writes.iter().enumerate() {
                if w.until == Until::Refcounted && self.counted(held, w)? {
                    ready = Some(i);
                    break;
                }
            }
            let Some(i) = ready else {
                return Ok(());
            };
            let w = &held.writes[i];
            if overlaps(&held.reftable, w.off, w.data.len() as u64) {
                self.write_file(w.off, &w.data)?;
            }
            held.writes.remove(i);
        }
    }

    /// Whether the file, after `w`, counts every refcount block that `w` newly enters into
    /// the refcount table (or `w` is no longer in the table).
    fn counted(&self, held: &Held, w: &HeldWrite) -> io::Result<bool> {
        let rt = &held.reftable;
        let range = w.range();
        if !overlaps(rt, range.start, range.end - range.start) {
            return Ok(true);
        }
        let on_disk = self.read_file(w.off, w.data.len())?;
        // The table is cluster-aligned, so its entries are 8-byte aligned in the file.
        let first = range.start.max(rt.start).next_multiple_of(8);
        let mut at = first;
        while at + 8 <= range.end.min(rt.end) {
            let i = usize::try_from(at - w.off).map_err(io::Error::other)?;
            let entry = be_u64(&w.data[i..i + 8]);
            let rb = entry & REFTABLE_OFFSET_MASK;
            if entry != be_u64(&on_disk[i..i + 8])
                && rb != 0
                && self.refcount(held, w, rb >> held.cluster_bits)? == 0
            {
                return Ok(false);
            }
            at += 8;
        }
        Ok(true)
    }

    /// The refcount of `cluster` in the file as it would be after `w`.
    fn refcount(&self, held: &Held, w: &HeldWrite, cluster: u64) -> io::Result<u64> {
        let order = held.refcount_order;
        // Entries per refcount block: cluster bytes * 8 / 2^order.
        let rb_bits = (held.cluster_bits + 3).saturating_sub(order);
        let rt_index = cluster >> rb_bits;
        let rb_index = cluster & ((1u64 << rb_bits) - 1);
        let Some(at) = rt_index
            .checked_mul(8)
            .and_then(|o| o.checked_add(held.reftable.start))
            .filter(|&at| at.saturating_add(8) <= held.reftable.end)
        else {
            return Ok(0);
        };
        let entry = if w.range().contains(&at) && at + 8 <= w.range().end {
            let i = usize::try_from(at - w.off).map_err(io::Error::other)?;
            be_u64(&w.data[i..i + 8])
        } else {
            be_u64(&self.read_file(at, 8)?)
        };
        let rb = entry & REFTABLE_OFFSET_MASK;
        if rb == 0 {
            return Ok(0);
        }
        let bits = 1u64 << order;
        let bit = rb_index * bits;
        let n = usize::try_from(bits.div_ceil(8)).map_err(io::Error::other)?;
        let bytes = self.read_file(rb + bit / 8, n)?;
        Ok(if bits < 8 {
            u64::from(bytes[0] >> (bit % 8)) & ((1u64 << bits) - 1)
        } else {
            be_u64(&bytes)
        })
    }
}

/// A big-endian integer of up to 8 bytes.
fn be_u64(b: &[u8]) -> u64 {
    b.iter().fold(0u64, |v, &x| (v << 8) | u64::from(x))
}

/// Tells a test that a write reached the file.
#[cfg(test)]
fn wrote() {
    tests::WROTE.with(|hook| {
        if let Some(hook) = hook.borrow_mut().as_mut() {
            hook();
        }
    });
}

#[cfg(not(test))]
fn wrote() {}

impl Storage for OrderedFile {
    fn open(opts: StorageOpenOptions) -> io::Result<Self> {
        let inner = ImagoFile::open(opts)?;
        let mut held = Held::default();
        let align = inner.mem_align().max(inner.req_align()).max(512);
        if inner.size()? >= align as u64 {
            let mut buf = IoBuffer::new(align, inner.mem_align().max(1))?;
            // SAFETY: one aligned block at offset 0, as `pure_readv` requires.
            unsafe { inner.pure_readv(IoVectorMut::from(&mut buf), 0) }?;
            held.header = buf.as_ref().into_slice()[..HEADER_PARSED.min(align)].to_vec();
            held.parse();
        }
        Ok(Self {
            inner,
            held: Mutex::new(held),
        })
    }

    fn mem_align(&self) -> usize {
        self.inner.mem_align()
    }

    fn req_align(&self) -> usize {
        self.inner.req_align()
    }

    fn zero_align(&self) -> usize {
        self.inner.zero_align()
    }

    fn discard_align(&self) -> usize {
        self.inner.discard_align()
    }

    fn size(&self) -> io::Result<u64> {
        self.inner.size()
    }

    fn resolve_relative_path<P: AsRef<Path>>(&self, relative: P) -> io::Result<PathBuf> {
        self.inner.resolve_relative_path(relative)
    }

    fn get_filename(&self) -> Option<PathBuf> {
        self.inner.get_filename()
    }

    unsafe fn pure_readv(&self, mut bufv: IoVectorMut<'_>, offset: u64) -> io::Result<()> {
        let held = self.held()?;
        let len = bufv.len();
        if !held.touches(offset, len) {
            drop(held);
            // SAFETY: the caller's request, unchanged.
            return unsafe { self.inner.pure_readv(bufv, offset) };
        }
        let mut buf = self.buffer(usize::try_from(len).map_err(io::Error::other)?)?;
        // SAFETY: the caller's (aligned) request into a buffer aligned for this file.
        unsafe { self.inner.pure_readv(IoVectorMut::from(&mut buf), offset) }?;
        let bytes = buf.as_mut().into_slice();
        held.apply(offset, bytes);
        bufv.copy_from_slice(bytes);
        Ok(())
    }

    unsafe fn pure_writev(&self, bufv: IoVector<'_>, offset: u64) -> io::Result<()> {
        let mut held = self.held()?;
        let len = bufv.len();
        let hold = held.holds(offset, len);
        if hold.is_none() && !held.touches(offset, len) {
            drop(held);
            // SAFETY: the caller's request, unchanged.
            unsafe { self.inner.pure_writev(bufv, offset) }?;
            wrote();
            return self.wrote_through();
        }
        let mut data = vec![0u8; usize::try_from(len).map_err(io::Error::other)?];
        bufv.copy_into_slice(&mut data);
        held.overlay(offset, &data);
        if let Some(until) = hold {
            held.parse();
            // A write inside an earlier held-back one is already in it (`overlay`): what is
            // held stays bounded by the L1 table, the refcount table and the header cluster.
            let covered = held
                .writes
                .iter()
                .any(|w| w.off <= offset && offset + len <= w.range().end);
            if !covered {
                held.writes.push(HeldWrite {
                    off: offset,
                    data,
                    until,
                });
            }
            if overlaps(&held.header_range, offset, len) {
                self.write_reftable_pointer(&held)?;
            }
            return self.settle(&mut held);
        }
        drop(held);
        // SAFETY: the caller's request, unchanged.
        unsafe { self.inner.pure_writev(bufv, offset) }?;
        wrote();
        self.wrote_through()
    }

    unsafe fn pure_write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        self.zeroed(offset, length)?;
        // SAFETY: the caller's request, unchanged.
        unsafe { self.inner.pure_write_zeroes(offset, length) }?;
        wrote();
        Ok(())
    }

    unsafe fn pure_write_allocated_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        self.zeroed(offset, length)?;
        // SAFETY: the caller's request, unchanged.
        unsafe { self.inner.pure_write_allocated_zeroes(offset, length) }?;
        wrote();
        Ok(())
    }

    unsafe fn pure_discard(&self, offset: u64, length: u64) -> io::Result<()> {
        // SAFETY: the caller's request, unchanged.
        unsafe { self.inner.pure_discard(offset, length) }?;
        wrote();
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        let mut held = self.held()?;
        self.release(&mut held)?;
        self.inner.flush()
    }

    fn sync(&self) -> io::Result<()> {
        self.inner.sync()
    }

    unsafe fn invalidate_cache(&self) -> io::Result<()> {
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.inner.invalidate_cache() }
    }

    fn get_storage_helper(&self) -> &CommonStorageHelper {
        self.inner.get_storage_helper()
    }

    fn resize(&self, new_size: u64, prealloc_mode: PreallocateMode) -> io::Result<()> {
        self.inner.resize(new_size, prealloc_mode)
    }
}

impl OrderedFile {
    /// After a write went through: writes the refcount table writes it made ready.
    fn wrote_through(&self) -> io::Result<()> {
        let mut held = self.held()?;
        if held.writes.iter().any(|w| w.until == Until::Refcounted) {
            self.settle(&mut held)?;
        }
        Ok(())
    }

    /// Zeroes what a zero write over `offset..offset + length` covers in held-back writes.
    fn zeroed(&self, offset: u64, length: u64) -> io::Result<()> {
        let mut held = self.held()?;
        if !held.touches(offset, length) {
            return Ok(());
        }
        let touched: Vec<Range<u64>> = held
            .writes
            .iter()
            .map(HeldWrite::range)
            .filter(|r| overlaps(r, offset, length))
            .collect();
        for r in touched {
            let start = r.start.max(offset);
            let end = r.end.min(offset.saturating_add(length));
            let zeros = vec![0u8; usize::try_from(end - start).map_err(io::Error::other)?];
            held.overlay(start, &zeros);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::process::Command;
    use std::rc::Rc;

    use super::*;

    thread_local! {
        /// Called after every write that reaches the image file (`imago` runs in the caller's
        /// thread in sync mode).
        pub(super) static WROTE: RefCell<Option<Box<dyn FnMut()>>> = const { RefCell::new(None) };
    }

    /// `qemu-img ARGS PATH...`, asserting it ran.
    fn qemu_img(args: &[&str], paths: &[&Path]) -> std::process::Output {
        Command::new("qemu-img")
            .args(args)
            .args(paths)
            .output()
            .unwrap()
    }

    /// A new qcow2 image `d.qcow2` of `size` with `cluster_size`-byte clusters in a temporary
    /// directory, or `None` when qemu-img is missing.
    fn new_image(cluster_size: u32, size: &str) -> Option<(tempfile::TempDir, PathBuf)> {
        if !bounce::testing::qemu_img_available() {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.qcow2");
        let created = qemu_img(
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-o",
                &format!("cluster_size={cluster_size}"),
            ],
            &[&path, Path::new(size)],
        );
        assert!(created.status.success());
        Some((dir, path))
    }

    /// The guest-visible bytes of the qcow2 image at `path`, converted to raw in `dir`.
    fn raw_contents(dir: &Path, path: &Path) -> Vec<u8> {
        let raw = dir.join("d.raw");
        assert!(qemu_img(&["convert", "-U", "-O", "raw"], &[path, &raw])
            .status
            .success());
        std::fs::read(&raw).unwrap()
    }

    /// `qemu-img check` of a copy of the file as it is now: what a SIGKILL of the process
    /// would leave (every write it made is in the file, nothing else).
    fn check_crash_image(path: &Path, what: &str) -> i32 {
        let copy = path.with_extension("crash");
        std::fs::copy(path, &copy).unwrap();
        let out = qemu_img(&["check", "-U"], &[&copy]);
        std::fs::remove_file(&copy).unwrap();
        let code = out.status.code().unwrap_or(-1);
        assert!(
            code == 0 || code == 3,
            "{what}: a crash now leaves a corrupt image (qemu-img check status {code}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .filter(|l| l.starts_with("ERROR"))
                .take(5)
                .collect::<Vec<_>>()
                .join("\n")
        );
        code
    }

    /// Allocating writes (new data clusters, a new L2 table every 2 MiB): a crash after any
    /// of them leaves an image with at most leaked clusters; after a flush, a clean image
    /// holding every write. Reads through the disk see the held-back L1 entries.
    #[test]
    fn a_crash_between_flushes_leaves_at_most_leaked_clusters() {
        let Some((dir, path)) = new_image(4096, "16M") else {
            return;
        };
        let disk = Qcow2Disk::open_with(&path, false, CacheMode::Writeback).unwrap();
        let offset = |i: u64| i * (1 << 20) + 512;
        let pattern =
            |i: u64| -> Vec<u8> { (0..4096u64).map(|b| (b * 7 + i * 13) as u8).collect() };
        for i in 0..12 {
            let mut data = pattern(i);
            disk.write_at(offset(i), &VolatileSlice::from(&mut data[..]))
                .unwrap();
            check_crash_image(&path, &format!("after write {i}"));
            let mut back = vec![0u8; 4096];
            disk.read_at(offset(i), &mut VolatileSlice::from(&mut back[..]))
                .unwrap();
            assert_eq!(back, pattern(i), "write {i} reads back before the flush");
            if i == 5 {
                disk.flush().unwrap();
                assert_eq!(check_crash_image(&path, "after a flush"), 0);
            }
        }
        disk.flush().unwrap();
        assert_eq!(check_crash_image(&path, "after the last flush"), 0);
        drop(disk);
        let img = raw_contents(dir.path(), &path);
        for i in 0..12 {
            let at = usize::try_from(offset(i)).unwrap();
            assert_eq!(&img[at..at + 4096], &pattern(i)[..], "write {i}");
        }
    }

    /// With 512-byte clusters a refcount block covers 128 KiB and the first refcount table
    /// 8 MiB: allocating writes create a new refcount block every few writes and grow (move)
    /// the refcount table once. A crash after any write leaves at most leaked clusters; after
    /// each flush, a clean image holding every write.
    #[test]
    fn a_crash_while_refcount_blocks_are_added_leaves_at_most_leaked_clusters() {
        let Some((dir, path)) = new_image(512, "32M") else {
            return;
        };
        let disk = Qcow2Disk::open_with(&path, false, CacheMode::Writeback).unwrap();
        const LEN: usize = 16 << 10;
        let offset = |i: u64| i * (64 << 10) + 512;
        let pattern =
            |i: u64| -> Vec<u8> { (0..LEN as u64).map(|b| (b * 7 + i * 13) as u8).collect() };
        const WRITES: u64 = 500;
        for i in 0..WRITES {
            let mut data = pattern(i);
            disk.write_at(offset(i), &VolatileSlice::from(&mut data[..]))
                .unwrap();
            check_crash_image(&path, &format!("after write {i}"));
            if i % 100 == 99 {
                disk.flush().unwrap();
                assert_eq!(check_crash_image(&path, "after a flush"), 0);
            }
        }
        disk.flush().unwrap();
        drop(disk);
        let img = raw_contents(dir.path(), &path);
        for i in 0..WRITES {
            let at = usize::try_from(offset(i)).unwrap();
            assert_eq!(&img[at..at + LEN], &pattern(i)[..], "write {i}");
        }
    }

    /// The guest bytes a test has written: as of the last flush, and now.
    struct Model {
        flushed: Vec<u8>,
        now: Vec<u8>,
    }

    /// Discards and flushes leave freed clusters below the end of the file, then writes that
    /// extend the last data cluster contiguously (`imago` allocates the next host cluster, not
    /// the first free one) cross a refcount block's coverage (256 clusters of 512 bytes): the
    /// new refcount block lands in a freed cluster whose refcount the file still has at 0. A
    /// copy of the file after every write that reaches it (what a SIGKILL would leave) passes
    /// `qemu-img check` with at most leaked clusters, and reads back, sector by sector, what
    /// was flushed or what was written since.
    #[test]
    fn a_crash_after_any_file_write_while_a_refcount_block_fills_a_hole_is_at_most_a_leak() {
        let Some((_dir, path)) = new_image(512, "4M") else {
            return;
        };
        const SECTOR: usize = 512;
        const GUEST: usize = 192 << 10;
        let model = Rc::new(RefCell::new(Model {
            flushed: vec![0; GUEST],
            now: vec![0; GUEST],
        }));
        let checks = Rc::new(RefCell::new(0u32));
        {
            let (path, model, checks) = (path.clone(), Rc::clone(&model), Rc::clone(&checks));
            let hook = move || {
                // Not again while a failed check unwinds through `imago` (it may write).
                if std::thread::panicking() {
                    return;
                }
                let n = {
                    let mut c = checks.borrow_mut();
                    *c += 1;
                    *c
                };
                let what = format!("after file write {n}");
                check_crash_image(&path, &what);
                let copy = path.with_extension("copy");
                std::fs::copy(&path, &copy).unwrap();
                let crashed = Qcow2Disk::open(&copy, true).unwrap();
                let mut back = vec![0u8; GUEST];
                crashed
                    .read_at(0, &mut VolatileSlice::from(&mut back[..]))
                    .unwrap();
                drop(crashed);
                std::fs::remove_file(&copy).unwrap();
                let m = model.borrow();
                for (s, got) in back.chunks(SECTOR).enumerate() {
                    let r = s * SECTOR..(s + 1) * SECTOR;
                    assert!(
                        got == &m.flushed[r.clone()] || got == &m.now[r],
                        "{what}: sector {s} holds neither its flushed nor its latest data"
                    );
                }
            };
            WROTE.with(|w| *w.borrow_mut() = Some(Box::new(hook)));
        }
        let disk = Qcow2Disk::open_with(&path, false, CacheMode::Writeback).unwrap();
        let write = |at: usize, len: usize, tag: u8| {
            let mut data: Vec<u8> = (0..len).map(|b| (b as u8).wrapping_mul(31) ^ tag).collect();
            model.borrow_mut().now[at..at + len].copy_from_slice(&data);
            disk.write_at(at as u64, &VolatileSlice::from(&mut data[..]))
                .unwrap();
        };
        let flush = || {
            disk.flush().unwrap();
            let mut m = model.borrow_mut();
            m.flushed = m.now.clone();
        };
        // 240 data clusters in a row, behind the header, tables and L2 tables: just below
        // the first refcount block's 256 clusters.
        let mut end = 240 * SECTOR;
        write(0, end, 1);
        flush();
        for round in 0..16u8 {
            // Free two clusters (the discarded range reads as whatever the disk says now)...
            for k in 0..2 {
                let at = (usize::from(round) * 8 + k * 4 + 1) * SECTOR;
                disk.discard(at as u64, SECTOR as u64).unwrap();
                let mut now = vec![0u8; SECTOR];
                disk.read_at(at as u64, &mut VolatileSlice::from(&mut now[..]))
                    .unwrap();
                model.borrow_mut().now[at..at + SECTOR].copy_from_slice(&now);
            }
            flush();
            // ...then extend the last data cluster by one, twice.
            for k in 0..2 {
                write(end - SECTOR, 2 * SECTOR, round * 2 + k + 2);
                end += SECTOR;
            }
        }
        flush();
        WROTE.with(|w| w.borrow_mut().take());
        let checked = *checks.borrow();
        assert!(checked > 50, "only {checked} file writes");
        let mut back = vec![0u8; GUEST];
        disk.read_at(0, &mut VolatileSlice::from(&mut back[..]))
            .unwrap();
        assert!(
            back == model.borrow().now,
            "the disk reads back what was written"
        );
    }
}
