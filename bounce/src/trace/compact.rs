//! The compact trace format: a trace's operations as binary records, for traces too large to
//! keep as JSON lines (the 6.12 kernel trace: 240 MB of JSON, 28 MB gzip'd, 0.9 MB compact).
//!
//! A compact trace holds exactly what the JSON reader makes of a trace, so [`CompactReader`]
//! yields the same `(line, TraceOp)` items as [`super::TraceReader`] on the JSON original,
//! line numbers included. What the JSON reader ignores is not kept: timestamps, `phase`, and
//! an unmap's `tlb_addr`, `size` and `dir` (the replay takes them from the live mapping). A
//! header record keeps the header line itself, so the capture's provenance (kernel, command
//! line, consistency counts) travels with the records.
//!
//! # Layout
//!
//! The file is gzip (best compression; [`super::open`] also reads the stream uncompressed)
//! of a *record stream*. Integers are LEB128 varints (at most 10 bytes, no bits beyond 64);
//! "Δ" marks a zigzag-encoded wrapping 64-bit difference from a value of the previous map
//! (0 before the first), which turns the kernel's rolling decisions into small numbers.
//!
//! | bytes | content |
//! |---|---|
//! | 8 | magic [`MAGIC`] |
//! | 2 | version, little-endian ([`VERSION`]) |
//! | ... | records, each a tag byte and its fields, then an end record |
//!
//! | tag | record | fields |
//! |---|---|---|
//! | 0 | end | records before it; nothing may follow |
//! | 1 | header | byte length (at most [`MAX_HEADER_BYTES`]), the header's JSON line (UTF-8) |
//! | 2 | map | flags; id Δ (previous id + 1), orig, size, worker, [min_align_mask], alloc_align_mask, [seg_boundary_mask], [kernel address Δ], [area used list, area index list] |
//! | 3 | unmap | flags; id Δ (previous map's id), [worker] |
//! | 4 | sync | flags; id Δ (previous map's id), offset, [size] |
//! | 5 | lines | extra lines before the next record (blank lines of the original) |
//!
//! Map flags: bits 0-1 the direction (Linux's 0, 1, 2), bit 2 skip-cpu-sync, bit 3 no-warn,
//! bit 4 a `min_align_mask`, bit 5 a `seg_boundary_mask`, bit 6 a kernel decision, bit 7 the
//! kernel returned an address (clear: "buffer is full"). With bit 6 two area lists follow, each
//! its length + 1 (0: absent, at most [`MAX_AREAS`] entries) and one Δ per entry from the
//! previous map's list at the same position. Unmap flags: bit 0 a worker, bit 1 attributes,
//! bit 2 skip-cpu-sync, bit 3 no-warn. Sync flags: bit 0 for the CPU (clear: for the device),
//! bit 1 a size. Any other flag bit, tag or direction is an error.
//!
//! A reader refuses a corrupt, truncated or unknown-version file with one
//! [`TraceError::Compact`] naming the byte of the record stream and the record, and stops
//! there; gzip's CRC guards the records, the end record's count their number.
//! [`write_compact`] is deterministic: the same JSON trace always gives the same bytes (for
//! one version of the compressor, pinned by `Cargo.lock`).

use std::io::{self, BufRead, Write};

use flate2::write::GzEncoder;
use flate2::Compression;

use super::parse::{parse_line, KernelDecision, MapOp, TraceOp};
use super::reader::TraceReader;
use super::{Result, TraceError};
use crate::types::{Direction, DmaAttrs};

/// The first bytes of a compact record stream: a non-ASCII byte, then a name, then a newline
/// (so neither a JSON trace nor text mangled by a line-ending conversion matches).
pub const MAGIC: [u8; 8] = *b"\x89BVMTRC\n";
/// The version of the record layout this build writes and reads.
pub const VERSION: u16 = 1;
/// Longest header line a compact trace holds.
pub const MAX_HEADER_BYTES: u64 = 1 << 20;
/// Longest area list a map record holds (Linux's swiotlb has at most one area per possible
/// CPU; 8192 is x86's largest `NR_CPUS`).
pub const MAX_AREAS: u64 = 8192;

// Record tags and flag bits of the compact format: constants, alike in shape only.
const TAG_END: u8 = 0;
const TAG_HEADER: u8 = 1;
const TAG_MAP: u8 = 2;
const TAG_UNMAP: u8 = 3;
const TAG_SYNC: u8 = 4;
const TAG_LINES: u8 = 5;

const MAP_DIR: u8 = 0b11;
const MAP_SKIP_CPU_SYNC: u8 = 1 << 2;
const MAP_NO_WARN: u8 = 1 << 3;
const MAP_MIN_ALIGN: u8 = 1 << 4;
const MAP_SEG_BOUNDARY: u8 = 1 << 5;
const MAP_KERNEL: u8 = 1 << 6;
const MAP_KERNEL_ADDR: u8 = 1 << 7;

const UNMAP_WORKER: u8 = 1 << 0;
const UNMAP_ATTRS: u8 = 1 << 1;
const UNMAP_SKIP_CPU_SYNC: u8 = 1 << 2;
const UNMAP_NO_WARN: u8 = 1 << 3;
const UNMAP_ALL: u8 = 0b1111;

const SYNC_FOR_CPU: u8 = 1 << 0;
const SYNC_SIZE: u8 = 1 << 1;
const SYNC_ALL: u8 = 0b11;

/// The values of the previous map that the next records are encoded against; the writer and
/// the reader update it identically.
#[derive(Debug, Default)]
struct Context {
    /// Id of the previous map (`None` before the first; the first map's id is coded against 0).
    map_id: Option<u64>,
    /// The kernel's address for the previous map that had one.
    tlb_addr: u64,
    /// The area lists of the previous map that had them.
    area_used: Vec<u64>,
    area_index: Vec<u64>,
}

impl Context {
    fn next_map_id(&self) -> u64 {
        self.map_id.map_or(0, |id| id.wrapping_add(1))
    }

    fn last_map_id(&self) -> u64 {
        self.map_id.unwrap_or(0)
    }
}

fn zigzag(v: u64, base: u64) -> u64 {
    let d = v.wrapping_sub(base) as i64;
    ((d << 1) ^ (d >> 63)) as u64
}

fn unzigzag(z: u64, base: u64) -> u64 {
    let d = (z >> 1) ^ (z & 1).wrapping_neg();
    base.wrapping_add(d)
}

fn attrs_bits(a: DmaAttrs, skip: u8, no_warn: u8) -> u8 {
    (if a.skip_cpu_sync { skip } else { 0 }) | (if a.no_warn { no_warn } else { 0 })
}

fn attrs_from(flags: u8, skip: u8, no_warn: u8) -> DmaAttrs {
    DmaAttrs {
        skip_cpu_sync: flags & skip != 0,
        no_warn: flags & no_warn != 0,
    }
}

// ------------------------------------------------------------------------------- writing

/// What [`write_compact`] wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CompactSummary {
    /// Operations written (headers, maps, unmaps, syncs).
    pub ops: u64,
    /// Maps among them.
    pub maps: u64,
    /// Unmaps among them.
    pub unmaps: u64,
}

/// Encodes records into a byte buffer, one record at a time.
#[derive(Debug, Default)]
struct Encoder {
    ctx: Context,
    buf: Vec<u8>,
    records: u64,
    line: u64,
}

impl Encoder {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.buf.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.buf.push(v as u8);
    }

    fn list(&mut self, line: u64, list: Option<&[usize]>, prev: &mut Vec<u64>) -> Result<()> {
        let Some(list) = list else {
            self.varint(0);
            return Ok(());
        };
        let n = list.len() as u64;
        if n > MAX_AREAS {
            return Err(TraceError::Parse {
                line,
                reason: format!("{n} areas; a compact trace holds at most {MAX_AREAS}"),
            });
        }
        self.varint(n + 1);
        let values: Vec<u64> = list.iter().map(|&v| v as u64).collect();
        for (i, &v) in values.iter().enumerate() {
            self.varint(zigzag(v, prev.get(i).copied().unwrap_or(0)));
        }
        *prev = values;
        Ok(())
    }

    /// Appends the records of the operation read from `line` (`text`: the line itself).
    /// The compact form holds what a `swiotlb-kernel-trace/1` replay reads; the dynamic
    /// pools' ops and decisions of `/2` have no records in it.
    fn dynamic_refused(line: u64) -> TraceError {
        TraceError::Parse {
            line,
            reason: "the compact form holds swiotlb-kernel-trace/1 only; keep a /2 trace \
                     (dynamic pools) as JSON lines"
                .into(),
        }
    }

    fn op(&mut self, line: u64, op: &TraceOp, text: &str) -> Result<()> {
        let gap = line.saturating_sub(self.line.saturating_add(1));
        if gap > 0 {
            self.buf.push(TAG_LINES);
            self.varint(gap);
            self.records += 1;
        }
        self.line = line;
        self.records += 1;
        match op {
            TraceOp::Header(h) if h.version > 1 => return Err(Self::dynamic_refused(line)),
            TraceOp::PoolAdd { .. }
            | TraceOp::TransientAlloc { .. }
            | TraceOp::TransientFree { .. } => return Err(Self::dynamic_refused(line)),
            TraceOp::Header(_) => {
                let text = text.trim();
                let n = text.len() as u64;
                if n > MAX_HEADER_BYTES {
                    return Err(TraceError::Parse {
                        line,
                        reason: format!(
                            "a header of {n} bytes; a compact trace holds at most {MAX_HEADER_BYTES}"
                        ),
                    });
                }
                self.buf.push(TAG_HEADER);
                self.varint(n);
                self.buf.extend_from_slice(text.as_bytes());
            }
            TraceOp::Map(m) => self.map(line, m)?,
            TraceOp::Unmap { id, worker, attrs } => {
                let mut flags = 0;
                if worker.is_some() {
                    flags |= UNMAP_WORKER;
                }
                if let Some(a) = attrs {
                    flags |= UNMAP_ATTRS | attrs_bits(*a, UNMAP_SKIP_CPU_SYNC, UNMAP_NO_WARN);
                }
                self.buf.extend_from_slice(&[TAG_UNMAP, flags]);
                self.varint(zigzag(*id, self.ctx.last_map_id()));
                if let Some(w) = worker {
                    self.varint(*w as u64);
                }
            }
            TraceOp::Sync {
                id,
                for_cpu,
                offset,
                size,
            } => {
                let flags = (if *for_cpu { SYNC_FOR_CPU } else { 0 })
                    | (if size.is_some() { SYNC_SIZE } else { 0 });
                self.buf.extend_from_slice(&[TAG_SYNC, flags]);
                self.varint(zigzag(*id, self.ctx.last_map_id()));
                self.varint(*offset as u64);
                if let Some(s) = size {
                    self.varint(*s as u64);
                }
            }
        }
        Ok(())
    }

    fn map(&mut self, line: u64, m: &MapOp) -> Result<()> {
        let mut flags = m.dir.to_linux() as u8 & MAP_DIR;
        flags |= attrs_bits(m.attrs, MAP_SKIP_CPU_SYNC, MAP_NO_WARN);
        if m.min_align_mask.is_some() {
            flags |= MAP_MIN_ALIGN;
        }
        if m.seg_boundary_mask.is_some() {
            flags |= MAP_SEG_BOUNDARY;
        }
        if let Some(k) = &m.kernel {
            flags |= MAP_KERNEL;
            if k.tlb_addr.is_some() {
                flags |= MAP_KERNEL_ADDR;
            }
        }
        self.buf.extend_from_slice(&[TAG_MAP, flags]);
        self.varint(zigzag(m.id, self.ctx.next_map_id()));
        self.ctx.map_id = Some(m.id);
        self.varint(m.orig);
        self.varint(m.size as u64);
        self.varint(m.worker as u64);
        if let Some(v) = m.min_align_mask {
            self.varint(v);
        }
        self.varint(m.alloc_align_mask);
        if let Some(v) = m.seg_boundary_mask {
            self.varint(v);
        }
        if let Some(k) = &m.kernel {
            if let Some(addr) = k.tlb_addr {
                self.varint(zigzag(addr, self.ctx.tlb_addr));
                self.ctx.tlb_addr = addr;
            }
            let mut prev = std::mem::take(&mut self.ctx.area_used);
            let r = self.list(line, k.area_used.as_deref(), &mut prev);
            self.ctx.area_used = prev;
            r?;
            let mut prev = std::mem::take(&mut self.ctx.area_index);
            let r = self.list(line, k.area_index.as_deref(), &mut prev);
            self.ctx.area_index = prev;
            r?;
        }
        Ok(())
    }

    fn end(&mut self) {
        self.buf.push(TAG_END);
        self.varint(self.records);
    }
}

/// `op` as a compact trace gives it back: a map without its timestamps (`MapOp::time`), which
/// only a `swiotlb-kernel-trace/2` replay reads (the compact form holds `/1` only).
pub fn as_stored(op: TraceOp) -> TraceOp {
    match op {
        TraceOp::Map(m) => TraceOp::Map(MapOp { time: None, ..m }),
        other => other,
    }
}

/// Writes every operation of the JSON-lines trace `json` to `out` as a compact trace (gzip'd
/// record stream, see the module documentation). `out_name` names `out` in errors. The same
/// input always gives the same bytes.
///
/// # Errors
/// The JSON trace's first read or parse error; [`TraceError::Parse`] for an operation the
/// format cannot hold (a header over [`MAX_HEADER_BYTES`], an area list over [`MAX_AREAS`]);
/// [`TraceError::Io`] when writing fails.
pub fn write_compact<R: BufRead, W: Write>(
    mut json: TraceReader<R>,
    out: W,
    out_name: &str,
) -> Result<CompactSummary> {
    let io = |source| TraceError::Io {
        path: out_name.to_string(),
        source,
    };
    let mut gz = GzEncoder::new(out, Compression::best());
    gz.write_all(&MAGIC).map_err(io)?;
    gz.write_all(&VERSION.to_le_bytes()).map_err(io)?;
    let mut enc = Encoder::default();
    let mut summary = CompactSummary::default();
    while let Some(item) = json.next() {
        let (line, op) = item?;
        enc.op(line, &op, json.last_line())?;
        summary.ops += 1;
        match op {
            TraceOp::Map(_) => summary.maps += 1,
            TraceOp::Unmap { .. } => summary.unmaps += 1,
            _ => {}
        }
        if enc.buf.len() >= 1 << 16 {
            gz.write_all(&enc.buf).map_err(io)?;
            enc.buf.clear();
        }
    }
    enc.end();
    gz.write_all(&enc.buf).map_err(io)?;
    gz.finish().map_err(io)?.flush().map_err(io)?;
    Ok(summary)
}

// ------------------------------------------------------------------------------- reading

/// Why a record could not be decoded.
enum Bad {
    /// The stream ended inside the record.
    Truncated,
    /// Reading the stream failed (for a gzip'd trace: corrupt compressed data or checksum).
    Io(io::Error),
    /// The bytes are not a valid record.
    Invalid(String),
}

impl From<io::Error> for Bad {
    fn from(e: io::Error) -> Self {
        Bad::Io(e)
    }
}

type Decoded<T> = std::result::Result<T, Bad>;

/// Reads the operations of a compact record stream (see the module documentation), yielding
/// the same `(line, TraceOp)` items as [`super::TraceReader`] on the JSON original. After the
/// first error it yields nothing more.
#[derive(Debug)]
pub struct CompactReader<R> {
    inner: R,
    name: String,
    /// Bytes of the record stream consumed.
    offset: u64,
    /// Where the record being read starts, and its 1-based number.
    at: (u64, u64),
    /// Records read, the end record excluded.
    records: u64,
    line: u64,
    ctx: Context,
    done: bool,
}

impl<R: BufRead> CompactReader<R> {
    /// Reads and checks the magic and version at the start of `inner`; `name` is used in
    /// errors.
    ///
    /// # Errors
    /// [`TraceError::Compact`] when `inner` does not start with [`MAGIC`] and [`VERSION`].
    pub fn new(inner: R, name: String) -> Result<Self> {
        let mut r = Self {
            inner,
            name,
            offset: 0,
            at: (0, 0),
            records: 0,
            line: 0,
            ctx: Context::default(),
            done: false,
        };
        let mut magic = [0u8; 8];
        for b in &mut magic {
            *b = r.byte().map_err(|e| r.error(0, 0, e))?;
        }
        if magic != MAGIC {
            return Err(r.error(0, 0, Bad::Invalid("not a compact trace (bad magic)".into())));
        }
        let version = u16::from_le_bytes([
            r.byte().map_err(|e| r.error(8, 0, e))?,
            r.byte().map_err(|e| r.error(8, 0, e))?,
        ]);
        if version != VERSION {
            return Err(r.error(
                8,
                0,
                Bad::Invalid(format!(
                    "unknown version {version} (this build reads version {VERSION})"
                )),
            ));
        }
        Ok(r)
    }

    /// The name used in errors.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn error(&self, offset: u64, record: u64, bad: Bad) -> TraceError {
        let reason = match bad {
            Bad::Truncated => "the stream ends inside the record (truncated file)".to_string(),
            Bad::Io(e) => format!("cannot read the stream (corrupt or truncated file): {e}"),
            Bad::Invalid(why) => why,
        };
        TraceError::Compact {
            path: self.name.clone(),
            offset,
            record,
            reason,
        }
    }

    /// The next byte, or `None` at the end of the stream.
    fn next_byte(&mut self) -> Decoded<Option<u8>> {
        loop {
            match self.inner.fill_buf() {
                Ok([]) => return Ok(None),
                Ok(buf) => {
                    let b = buf[0];
                    self.inner.consume(1);
                    self.offset += 1;
                    return Ok(Some(b));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Bad::Io(e)),
            }
        }
    }

    fn byte(&mut self) -> Decoded<u8> {
        self.next_byte()?.ok_or(Bad::Truncated)
    }

    fn varint(&mut self) -> Decoded<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            let bits = u64::from(b & 0x7f);
            if shift == 63 && bits > 1 {
                return Err(Bad::Invalid("a varint over 64 bits".into()));
            }
            v |= bits << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(Bad::Invalid("a varint over 10 bytes".into()))
    }

    fn usize(&mut self, what: &str) -> Decoded<usize> {
        let v = self.varint()?;
        usize::try_from(v).map_err(|_| Bad::Invalid(format!("{what} {v} does not fit")))
    }

    fn flags(&mut self, allowed: u8, what: &str) -> Decoded<u8> {
        let f = self.byte()?;
        if f & !allowed != 0 {
            return Err(Bad::Invalid(format!("unknown {what} flags {f:#04x}")));
        }
        Ok(f)
    }

    fn list(&mut self, prev: &mut Vec<u64>) -> Decoded<Option<Vec<usize>>> {
        let n = self.varint()?;
        if n == 0 {
            return Ok(None);
        }
        let n = n - 1;
        if n > MAX_AREAS {
            return Err(Bad::Invalid(format!(
                "{n} areas (at most {MAX_AREAS} allowed)"
            )));
        }
        let mut values = Vec::with_capacity(n as usize);
        for i in 0..n as usize {
            values.push(unzigzag(self.varint()?, prev.get(i).copied().unwrap_or(0)));
        }
        let list = values
            .iter()
            .map(|&v| usize::try_from(v))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| Bad::Invalid("an area count that does not fit".into()))?;
        *prev = values;
        Ok(Some(list))
    }

    fn map(&mut self) -> Decoded<TraceOp> {
        let flags = self.byte()?;
        let dir = Direction::from_linux(u64::from(flags & MAP_DIR))
            .ok_or_else(|| Bad::Invalid(format!("bad direction {}", flags & MAP_DIR)))?;
        if flags & MAP_KERNEL_ADDR != 0 && flags & MAP_KERNEL == 0 {
            return Err(Bad::Invalid(format!(
                "map flags {flags:#04x}: a kernel address without a kernel decision"
            )));
        }
        let id = unzigzag(self.varint()?, self.ctx.next_map_id());
        self.ctx.map_id = Some(id);
        let orig = self.varint()?;
        let size = self.usize("size")?;
        let worker = self.usize("worker")?;
        let min_align_mask = if flags & MAP_MIN_ALIGN != 0 {
            Some(self.varint()?)
        } else {
            None
        };
        let alloc_align_mask = self.varint()?;
        let seg_boundary_mask = if flags & MAP_SEG_BOUNDARY != 0 {
            Some(self.varint()?)
        } else {
            None
        };
        let kernel = if flags & MAP_KERNEL != 0 {
            let tlb_addr = if flags & MAP_KERNEL_ADDR != 0 {
                let a = unzigzag(self.varint()?, self.ctx.tlb_addr);
                self.ctx.tlb_addr = a;
                Some(a)
            } else {
                None
            };
            let mut prev = std::mem::take(&mut self.ctx.area_used);
            let area_used = self.list(&mut prev);
            self.ctx.area_used = prev;
            let mut prev = std::mem::take(&mut self.ctx.area_index);
            let area_index = self.list(&mut prev);
            self.ctx.area_index = prev;
            Some(KernelDecision {
                tlb_addr,
                area_used: area_used?,
                area_index: area_index?,
                pool: None,
                grow: false,
                counters: None,
            })
        } else {
            None
        };
        Ok(TraceOp::Map(MapOp {
            id,
            orig,
            size,
            worker,
            dir,
            attrs: attrs_from(flags, MAP_SKIP_CPU_SYNC, MAP_NO_WARN),
            min_align_mask,
            alloc_align_mask,
            seg_boundary_mask,
            kernel,
            time: None,
        }))
    }

    fn header(&mut self, line: u64) -> Decoded<TraceOp> {
        let n = self.varint()?;
        if n > MAX_HEADER_BYTES {
            return Err(Bad::Invalid(format!(
                "a header of {n} bytes (at most {MAX_HEADER_BYTES} allowed)"
            )));
        }
        let mut text = Vec::with_capacity(n as usize);
        for _ in 0..n {
            text.push(self.byte()?);
        }
        let text = String::from_utf8(text)
            .map_err(|_| Bad::Invalid("a header that is not UTF-8".into()))?;
        match parse_line(line, &text) {
            Ok(Some(op @ TraceOp::Header(_))) => Ok(op),
            Ok(_) => Err(Bad::Invalid("a header record that holds no header".into())),
            Err(e) => Err(Bad::Invalid(format!("header: {e}"))),
        }
    }

    /// Decodes the next operation; `Ok(None)` after a valid end record at the end of the
    /// stream.
    fn decode(&mut self) -> Decoded<Option<(u64, TraceOp)>> {
        loop {
            self.at = (self.offset, self.records + 1);
            let Some(tag) = self.next_byte()? else {
                return Err(Bad::Invalid(format!(
                    "the stream ends after {} records without its end record (truncated file)",
                    self.records
                )));
            };
            if tag == TAG_END {
                let n = self.varint()?;
                if n != self.records {
                    return Err(Bad::Invalid(format!(
                        "the end record counts {n} records, the stream holds {}",
                        self.records
                    )));
                }
                // Reading to the end also makes a gzip decoder check its CRC.
                if self.next_byte()?.is_some() {
                    return Err(Bad::Invalid("bytes after the end record".into()));
                }
                return Ok(None);
            }
            self.records += 1;
            if tag == TAG_LINES {
                let n = self.varint()?;
                self.line = self.line.saturating_add(n);
                continue;
            }
            self.line = self.line.saturating_add(1);
            let op = match tag {
                TAG_HEADER => self.header(self.line)?,
                TAG_MAP => self.map()?,
                TAG_UNMAP => {
                    let flags = self.flags(UNMAP_ALL, "unmap")?;
                    let id = unzigzag(self.varint()?, self.ctx.last_map_id());
                    let worker = if flags & UNMAP_WORKER != 0 {
                        Some(self.usize("worker")?)
                    } else {
                        None
                    };
                    let attrs = (flags & UNMAP_ATTRS != 0)
                        .then(|| attrs_from(flags, UNMAP_SKIP_CPU_SYNC, UNMAP_NO_WARN));
                    if attrs.is_none() && flags & (UNMAP_SKIP_CPU_SYNC | UNMAP_NO_WARN) != 0 {
                        return Err(Bad::Invalid(format!(
                            "unmap flags {flags:#04x}: attribute bits without attributes"
                        )));
                    }
                    TraceOp::Unmap { id, worker, attrs }
                }
                TAG_SYNC => {
                    let flags = self.flags(SYNC_ALL, "sync")?;
                    let id = unzigzag(self.varint()?, self.ctx.last_map_id());
                    let offset = self.usize("offset")?;
                    let size = if flags & SYNC_SIZE != 0 {
                        Some(self.usize("size")?)
                    } else {
                        None
                    };
                    TraceOp::Sync {
                        id,
                        for_cpu: flags & SYNC_FOR_CPU != 0,
                        offset,
                        size,
                    }
                }
                other => return Err(Bad::Invalid(format!("unknown record tag {other}"))),
            };
            return Ok(Some((self.line, op)));
        }
    }
}

impl<R: BufRead> Iterator for CompactReader<R> {
    type Item = Result<(u64, TraceOp)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        match self.decode() {
            Ok(Some(item)) => Some(Ok(item)),
            Ok(None) => {
                self.done = true;
                None
            }
            Err(bad) => {
                self.done = true;
                let (offset, record) = self.at;
                Some(Err(self.error(offset, record, bad)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::open;
    use std::io::{BufReader, Cursor};
    use std::path::Path;

    /// Every kind of record and optional field, blank lines, two headers, several areas.
    const MIXED: &str = r#"{"op":"header","format":"swiotlb-kernel-trace/1","nslabs":4096,"nareas":2,"start":955252736,"cpus":2,"kernel":"6.12","area_index_at_start":[5,9],"area_used_at_start":[0,0]}
{"op":"map","id":0,"orig":1049125112,"size":16,"cpu":1,"min_align_mask":0,"alloc_align_mask":0,"dir":1,"attrs":0,"ts":1,"kernel_area_used":[1,0],"kernel_area_index":[1,9],"kernel_tlb_addr":955252736}

{"op":"map","id":1,"orig":479780864,"size":262144,"cpu":0,"dir":2,"attrs":288,"kernel_tlb_addr":null,"kernel_error":"full","kernel_area_used":[1,0],"kernel_area_index":[1,9]}
{"op":"map","id":7,"orig":4096,"size":512,"dir":"bidirectional","worker":3,"seg_boundary_mask":65535,"alloc_align_mask":4095}
{"op":"map","id":3,"orig":18446744073709551615,"size":1,"dir":0,"kernel_tlb_addr":955250688}
{"op":"sync_for_cpu","id":7,"offset":8}
{"op":"sync_for_device","id":7,"offset":0,"size":512}


{"op":"unmap","id":0,"tlb_addr":955252736,"size":16,"cpu":1,"dir":1,"attrs":32}
{"op":"unmap","id":7}
{"op":"unmap","id":3,"worker":1,"attrs":256}
{"op":"header","nslabs":128}
{"op":"map","id":0,"orig":0,"size":2048,"dir":1,"kernel_tlb_addr":0,"kernel_area_used":[3]}
"#;

    /// The JSON reader's items, as the compact form stores them.
    fn json_items(text: &str) -> Vec<(u64, TraceOp)> {
        TraceReader::from_reader(text.as_bytes(), "json".into())
            .map(|i| i.map(|(line, op)| (line, as_stored(op))))
            .collect::<Result<_>>()
            .unwrap()
    }

    fn compact(text: &str) -> Vec<u8> {
        let mut out = Vec::new();
        write_compact(
            TraceReader::from_reader(text.as_bytes(), "json".into()),
            &mut out,
            "out",
        )
        .unwrap();
        out
    }

    /// The record stream inside a compact file.
    fn records(gz: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(gz), &mut out).unwrap();
        out
    }

    fn read_stream(bytes: &[u8]) -> Result<Vec<(u64, TraceOp)>> {
        CompactReader::new(BufReader::new(bytes), "t".into())?.collect()
    }

    /// What `open` makes of `bytes` written to a file.
    fn read_file(bytes: &[u8]) -> Result<Vec<(u64, TraceOp)>> {
        let dir = std::env::temp_dir().join(format!("bounce-compact-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{:x}.bin", crate_hash(bytes)));
        std::fs::write(&path, bytes).unwrap();
        let r = open(&path).and_then(|t| t.collect::<Result<Vec<_>>>());
        let _ = std::fs::remove_file(&path);
        r
    }

    fn crate_hash(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        })
    }

    #[test]
    fn round_trip_gives_the_json_readers_items() {
        let want = json_items(MIXED);
        assert_eq!(want.len(), 12);
        let file = compact(MIXED);
        assert_eq!(read_stream(&records(&file)).unwrap(), want);
        assert_eq!(read_file(&file).unwrap(), want, "open() sniffs the format");
        assert_eq!(
            read_file(&records(&file)).unwrap(),
            want,
            "an uncompressed stream"
        );
        assert_eq!(compact(MIXED), file, "deterministic");
        let json: Vec<_> = read_file(MIXED.as_bytes())
            .unwrap()
            .into_iter()
            .map(|(line, op)| (line, as_stored(op)))
            .collect();
        assert_eq!(json, want, "JSON still read");
    }

    #[test]
    fn round_trip_of_the_trace_excerpt() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/trace-head.jsonl");
        let text = std::fs::read_to_string(path).unwrap();
        let want = json_items(&text);
        assert_eq!(want.len(), 2000);
        let file = compact(&text);
        assert_eq!(read_file(&file).unwrap(), want);
        assert!(file.len() * 20 < text.len(), "{} bytes", file.len());
    }

    fn error_of(r: Result<Vec<(u64, TraceOp)>>) -> String {
        let e = r.expect_err("accepted").to_string();
        assert!(!e.contains('\n'), "one line: {e}");
        e
    }

    #[test]
    fn refuses_a_bad_magic_or_an_unknown_version() {
        let mut s = records(&compact(MIXED));
        s[9] = 0;
        s[8] = 2;
        let e = error_of(read_stream(&s));
        assert!(
            e.contains("byte 8") && e.contains("unknown version 2"),
            "{e}"
        );
        s[0] = b'{';
        assert!(error_of(read_stream(&s)).contains("bad magic"));
        assert!(error_of(read_stream(&MAGIC[..5])).contains("truncated"));
    }

    #[test]
    fn refuses_a_truncated_file_at_every_length() {
        let file = compact(MIXED);
        let stream = records(&file);
        for cut in MAGIC.len() + 2..stream.len() {
            let e = error_of(read_stream(&stream[..cut]));
            assert!(e.contains("truncated"), "cut at {cut}: {e}");
        }
        for cut in 0..file.len() {
            let r = read_file(&file[..cut]);
            if cut == 0 {
                // An empty file is an empty JSON trace.
                assert_eq!(r.unwrap(), vec![]);
                continue;
            }
            let items = r.expect_err(&format!("a file cut at {cut} of {} read", file.len()));
            assert!(!items.to_string().contains('\n'));
        }
    }

    #[test]
    fn a_corrupt_file_gives_an_error_or_the_same_items_never_a_panic() {
        let want = json_items(MIXED);
        let file = compact(MIXED);
        let mut errors = 0;
        for at in 0..file.len() {
            for bit in [0x01u8, 0x80] {
                let mut bad = file.clone();
                bad[at] ^= bit;
                match read_file(&bad) {
                    Ok(items) => assert_eq!(items, want, "flip at byte {at} went unnoticed"),
                    Err(e) => {
                        assert!(!e.to_string().contains('\n'));
                        errors += 1;
                    }
                }
            }
        }
        // Only gzip header fields outside its checksum (time, flags) may flip unnoticed.
        assert!(errors > 2 * file.len() - 20, "{errors}");
    }

    #[test]
    fn names_the_record_and_byte_of_a_bad_record() {
        let mut s = records(&compact(MIXED));
        // The first record starts after magic and version: the header (tag 1).
        assert_eq!(s[10], TAG_HEADER);
        s[10] = 9;
        let e = error_of(read_stream(&s));
        assert!(
            e.contains("byte 10") && e.contains("record 1") && e.contains("unknown record tag 9"),
            "{e}"
        );

        let s = records(&compact(MIXED));
        let header_len = usize::from(s[11]) | (usize::from(s[12]) << 7);
        let map = 13 + header_len;
        assert_eq!(s[map], TAG_MAP);
        let mut bad = s.clone();
        bad[map + 1] |= MAP_DIR;
        let e = error_of(read_stream(&bad));
        assert!(
            e.contains(&format!("byte {map}"))
                && e.contains("record 2")
                && e.contains("bad direction 3"),
            "{e}"
        );
        let mut bad = s.clone();
        bad[map + 1] = MAP_KERNEL_ADDR | 1;
        assert!(error_of(read_stream(&bad)).contains("kernel address without"));

        // The end record's count, and bytes after it.
        let n = s.len();
        let mut bad = s.clone();
        bad[n - 1] += 1;
        assert!(error_of(read_stream(&bad)).contains("end record counts"));
        let mut bad = s.clone();
        bad.push(0);
        assert!(error_of(read_stream(&bad)).contains("after the end record"));
    }

    #[test]
    fn refuses_oversized_varints_lists_and_headers() {
        let stream = |body: &[u8]| {
            let mut s = MAGIC.to_vec();
            s.extend_from_slice(&VERSION.to_le_bytes());
            s.extend_from_slice(body);
            s
        };
        let e = error_of(read_stream(&stream(&[
            TAG_END, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02,
        ])));
        assert!(e.contains("over 64 bits"), "{e}");
        let e = error_of(read_stream(&stream(&[
            TAG_END, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0,
        ])));
        assert!(e.contains("over"), "{e}");
        // A map with a kernel decision and a used list of 2^20 entries.
        let e = error_of(read_stream(&stream(&[
            TAG_MAP, MAP_KERNEL, 0, 0, 1, 0, 0, 0x81, 0x80, 0x40,
        ])));
        assert!(e.contains("areas (at most 8192"), "{e}");
        let e = error_of(read_stream(&stream(&[TAG_HEADER, 0xff, 0xff, 0xff, 0x7f])));
        assert!(e.contains("header of"), "{e}");
        let e = error_of(read_stream(&stream(&[TAG_HEADER, 2, b'{', b'}'])));
        assert!(e.contains("header: trace line 1"), "{e}");
        let e = error_of(read_stream(&stream(&[TAG_UNMAP, 0x10, 0])));
        assert!(e.contains("unknown unmap flags"), "{e}");
        let e = error_of(read_stream(&stream(&[TAG_SYNC, 0x04, 0, 0])));
        assert!(e.contains("unknown sync flags"), "{e}");
        let e = error_of(read_stream(&stream(&[])));
        assert!(e.contains("without its end record"), "{e}");
        assert_eq!(read_stream(&stream(&[TAG_END, 0])).unwrap(), vec![]);
    }

    #[test]
    fn the_writer_refuses_what_the_format_cannot_hold() {
        let areas = vec!["0"; MAX_AREAS as usize + 1].join(",");
        let text = format!(
            "{{\"op\":\"map\",\"id\":0,\"orig\":0,\"size\":1,\"dir\":1,\"kernel_tlb_addr\":0,\"kernel_area_used\":[{areas}]}}\n"
        );
        let e = write_compact(
            TraceReader::from_reader(text.as_bytes(), "j".into()),
            Vec::new(),
            "o",
        )
        .unwrap_err();
        assert!(e.to_string().contains("trace line 1: 8193 areas"), "{e}");
    }

    proptest::proptest! {
        #![proptest_config(crate::testing::fuzz_config(2000))]

        /// Arbitrary bytes after a valid magic and version: an error or some items, never a
        /// panic, a hang or an allocation beyond the format's bounds.
        #[test]
        fn arbitrary_records_never_panic(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
            let mut s = MAGIC.to_vec();
            s.extend_from_slice(&VERSION.to_le_bytes());
            s.extend_from_slice(&body);
            let mut r = CompactReader::new(Cursor::new(s), "f".into()).unwrap();
            let mut n = 0;
            while let Some(item) = r.next() {
                n += 1;
                proptest::prop_assert!(n <= body.len() + 1);
                if let Err(e) = item {
                    proptest::prop_assert!(!e.to_string().contains('\n'));
                    proptest::prop_assert!(r.next().is_none(), "nothing after an error");
                    break;
                }
            }
        }
    }
}
