//! The one descriptor-chain walker every device uses (block requests, net TX and RX, the net
//! control queue).
//!
//! [`walk`] reads a split-ring chain (direct descriptors, and at most one level of indirect
//! table) into the device-readable and device-writable buffer lists of a [`Chain`]. Descriptor
//! tables are ring memory and are read directly; buffers are not touched, only checked to lie
//! in guest memory with the permission their direction needs, so a [`Seg`] always names guest
//! memory.
//!
//! # Rules (the same for every device)
//! - A descriptor index must be inside its table (the queue, or the indirect table).
//! - A chain is bounded: at most `queue_size` direct descriptors (more can only be a loop),
//!   and an indirect table of at most [`WalkRules::max_indirect`] entries — the device's own
//!   maximum, not the negotiated ring size (a 128-entry ring may carry a 256-entry indirect
//!   table, as QEMU accepts up to its own limit).
//! - Indirect tables only when negotiated, never nested, never on a descriptor with NEXT, with
//!   a length that is a non-zero multiple of 16.
//! - **Zero-length descriptors are refused** ([`ChainError::ZeroLength`]), for every device.
//!   QEMU refuses them too ("zero sized buffers are not allowed"); a correct driver never posts
//!   one, and refusing them keeps "a buffer" and "a byte range" the same thing everywhere.
//! - No device-readable descriptor after a device-writable one (virtio 1.2, 2.7.4.2).
//! - Every buffer lies in guest memory (readable, or writable for device-writable buffers).
//!
//! Errors come in two kinds. A *structural* error (a bad index, a loop, a table outside guest
//! memory, a bad indirect table) ends the walk: the chain cannot be enumerated, so nothing in
//! it can be trusted to hold a status byte, and [`Chain::is_complete`] is false. A *content*
//! error (zero length, readable after writable, a buffer outside guest memory) is recorded, the
//! walk goes on to the end of the chain, and the first such error is returned with a complete
//! [`Chain`], so a device can still find where its status byte is and report the error there.
//!
//! [`copy_from`] and [`copy_to`] move a byte range of a buffer list through a [`bounce::Dma`]
//! handle in pieces (one small map → copy → unmap per piece,
//! [`bounce::Dma::read_guest`] and [`bounce::Dma::write_guest`] with
//! [`bounce::RangeCheck::Prevalidated`]: a buffer the walker pushed is in guest memory, the
//! walk was its one check);
//! [`for_each_piece`] is the stream arithmetic under them.

use std::mem::size_of;

use bounce::{Dma, RangeCheck};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions};

use super::spec::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};

/// Size of one split-ring descriptor.
pub const DESC_SIZE: u64 = 16;

/// Why a chain was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// A descriptor index outside its table.
    #[error("descriptor index {index} out of range (table of {table_len})")]
    IndexOutOfRange {
        /// The index.
        index: u16,
        /// Entries in the table.
        table_len: u16,
    },
    /// More descriptors than the table holds: a loop.
    #[error("descriptor loop")]
    Loop,
    /// A descriptor table entry outside guest memory.
    #[error("descriptor table entry at {addr:#x} is outside guest memory")]
    TableOutsideMemory {
        /// Address of the entry.
        addr: u64,
    },
    /// An indirect descriptor while RING_INDIRECT_DESC was not negotiated.
    #[error("indirect descriptor not negotiated")]
    IndirectNotNegotiated,
    /// An indirect descriptor inside an indirect table.
    #[error("nested indirect table")]
    NestedIndirect,
    /// An indirect descriptor with NEXT set.
    #[error("indirect descriptor with NEXT")]
    IndirectWithNext,
    /// An indirect table length that is 0 or not a multiple of 16.
    #[error("indirect table length {len} is not a non-zero multiple of 16")]
    BadIndirectLength {
        /// The length.
        len: u32,
    },
    /// An indirect table longer than the device accepts.
    #[error("indirect table of {entries} entries exceeds the device's maximum of {max}")]
    IndirectTooLong {
        /// Entries in the table.
        entries: u64,
        /// The device's maximum.
        max: u16,
    },
    /// A zero-length buffer.
    #[error("zero-length descriptor")]
    ZeroLength,
    /// A device-readable buffer after a device-writable one.
    #[error("device-readable descriptor after a writable one")]
    ReadableAfterWritable,
    /// A buffer outside guest memory (or without the permission its direction needs).
    #[error("buffer {addr:#x}+{len:#x} is outside guest memory")]
    OutsideMemory {
        /// Guest address.
        addr: u64,
        /// Length.
        len: u32,
    },
}

impl ChainError {
    /// True when the chain could not be enumerated (see the module docs).
    pub fn is_structural(&self) -> bool {
        !matches!(
            self,
            Self::ZeroLength | Self::ReadableAfterWritable | Self::OutsideMemory { .. }
        )
    }
}

/// One guest buffer of a chain, checked to lie in guest memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seg {
    /// Guest address.
    pub addr: u64,
    /// Length in bytes (never 0).
    pub len: u32,
}

/// The buffers of one chain, split by direction, in chain order.
#[derive(Clone, Debug, Default)]
pub struct Chain {
    /// Device-readable buffers.
    pub readable: Vec<Seg>,
    /// Device-writable buffers.
    pub writable: Vec<Seg>,
    /// Sum of the readable lengths.
    pub readable_len: u64,
    /// Sum of the writable lengths.
    pub writable_len: u64,
    complete: bool,
    /// A descriptor was left out after the last device-writable one kept: where the
    /// writable stream really ends is unknown.
    tail_lost: bool,
}

impl Chain {
    /// Empties the chain (keeping its allocations).
    pub fn clear(&mut self) {
        self.readable.clear();
        self.writable.clear();
        self.readable_len = 0;
        self.writable_len = 0;
        self.complete = false;
        self.tail_lost = false;
    }

    /// True when the walk reached the chain's last descriptor (even if it then reported a
    /// content error): the lists hold every valid buffer of the chain.
    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// The guest address of the last device-writable byte (where virtio-blk's status byte
    /// is), if the chain is complete, has one, and no descriptor was left out after it (a
    /// refused descriptor there may be where the driver expects its status: writing
    /// elsewhere would leave the driver's byte stale).
    pub fn last_writable_byte(&self) -> Option<u64> {
        if !self.complete || self.tail_lost {
            return None;
        }
        let s = self.writable.last()?;
        // len >= 1, and addr + len was checked against guest memory.
        s.addr.checked_add(u64::from(s.len) - 1)
    }

    fn push(&mut self, seg: Seg, writable: bool) {
        if writable {
            self.tail_lost = false;
            self.writable.push(seg);
            self.writable_len += u64::from(seg.len);
        } else {
            self.readable.push(seg);
            self.readable_len += u64::from(seg.len);
        }
    }
}

/// What a device accepts in a chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WalkRules {
    /// RING_INDIRECT_DESC was negotiated.
    pub indirect: bool,
    /// Largest indirect table, in descriptors: the device's own maximum (its largest queue
    /// size), whatever ring size the driver chose.
    pub max_indirect: u16,
}

/// Where a popped chain is: its head and the table it starts in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainHead {
    /// The head index (the used-ring id), always `< queue_size`.
    pub head: u16,
    /// Guest address of the queue's descriptor table.
    pub desc_table: u64,
    /// The negotiated queue size.
    pub queue_size: u16,
}

impl ChainHead {
    /// Walks this chain into `out` ([`walk`]).
    ///
    /// # Errors
    /// As [`walk`].
    pub fn walk<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        rules: &WalkRules,
        out: &mut Chain,
    ) -> Result<(), ChainError> {
        walk(mem, self, rules, out)
    }
}

/// Reads the chain at `at` into `out` under `rules` (see the module docs for the rules).
///
/// The work is bounded by `queue_size + max_indirect + 1` descriptor reads whatever the guest
/// wrote.
///
/// # Errors
/// The first rule broken. After a content error `out` is still complete
/// ([`Chain::is_complete`]); after a structural one it is not.
pub fn walk<M: GuestMemory + ?Sized>(
    mem: &M,
    at: &ChainHead,
    rules: &WalkRules,
    out: &mut Chain,
) -> Result<(), ChainError> {
    out.clear();
    let mut table = at.desc_table;
    let mut table_len = at.queue_size;
    let mut index = at.head;
    let mut in_indirect = false;
    // Descriptors left to read in the current table: a chain that visits more than the
    // table holds revisits one, i.e. loops.
    let mut budget = u32::from(table_len);
    let mut first_error = None;
    loop {
        if index >= table_len {
            return Err(ChainError::IndexOutOfRange { index, table_len });
        }
        budget = budget.checked_sub(1).ok_or(ChainError::Loop)?;
        // index < table_len <= 65535, so index * 16 cannot overflow a u64.
        let addr = table
            .checked_add(u64::from(index) * DESC_SIZE)
            .ok_or(ChainError::TableOutsideMemory { addr: table })?;
        let desc: Descriptor = mem
            .read_obj(GuestAddress(addr))
            .map_err(|_| ChainError::TableOutsideMemory { addr })?;
        let flags = desc.flags();
        if flags & VRING_DESC_F_INDIRECT != 0 {
            if !rules.indirect {
                return Err(ChainError::IndirectNotNegotiated);
            }
            if in_indirect {
                return Err(ChainError::NestedIndirect);
            }
            if flags & VRING_DESC_F_NEXT != 0 {
                return Err(ChainError::IndirectWithNext);
            }
            let len = desc.len();
            if len == 0 || u64::from(len) % DESC_SIZE != 0 {
                return Err(ChainError::BadIndirectLength { len });
            }
            let entries = u64::from(len) / DESC_SIZE;
            let max = rules.max_indirect;
            let Some(n) = u16::try_from(entries).ok().filter(|&n| n <= max) else {
                return Err(ChainError::IndirectTooLong { entries, max });
            };
            table = desc.addr().0;
            table_len = n;
            index = 0;
            in_indirect = true;
            budget = u32::from(n);
            continue;
        }
        let len = desc.len();
        let writable = flags & VRING_DESC_F_WRITE != 0;
        let seg = Seg {
            addr: desc.addr().0,
            len,
        };
        let perm = if writable {
            Permissions::Write
        } else {
            Permissions::Read
        };
        let problem = if len == 0 {
            Some(ChainError::ZeroLength)
        } else if !mem.check_range(desc.addr(), len as usize, perm) {
            Some(ChainError::OutsideMemory {
                addr: seg.addr,
                len,
            })
        } else if !writable && !out.writable.is_empty() {
            Some(ChainError::ReadableAfterWritable)
        } else {
            None
        };
        match problem {
            None => out.push(seg, writable),
            Some(e) => {
                out.tail_lost = true;
                first_error.get_or_insert(e);
            }
        }
        if flags & VRING_DESC_F_NEXT == 0 {
            out.complete = true;
            return first_error.map_or(Ok(()), Err);
        }
        index = desc.next();
    }
}

/// Errors of [`copy_from`] and [`copy_to`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    /// The buffers hold fewer bytes than asked for.
    #[error("buffers hold {have} bytes, {want} needed")]
    Short {
        /// Bytes needed (end of the range).
        want: u64,
        /// Bytes the buffers hold.
        have: u64,
    },
    /// A buffer's address plus an offset overflows (a hand-made [`Seg`]; the walker never
    /// produces one).
    #[error("buffer {addr:#x} + {offset:#x} overflows")]
    Overflow {
        /// Buffer address.
        addr: u64,
        /// Offset into it.
        offset: u64,
    },
    /// The DMA handle refused.
    #[error(transparent)]
    Dma(#[from] bounce::Error),
}

/// Calls `f(addr, len)` for each contiguous piece of bytes `start..start + len` of the byte
/// stream that `segs` form, in order, with no piece longer than `max_piece`.
///
/// # Errors
/// [`CopyError::Short`] when the stream ends first; `f`'s error.
pub fn for_each_piece<E, F>(
    segs: &[Seg],
    start: u64,
    len: u64,
    max_piece: u64,
    mut f: F,
) -> Result<(), E>
where
    E: From<CopyError>,
    F: FnMut(u64, usize) -> Result<(), E>,
{
    let max_piece = max_piece.max(1);
    let mut skip = start;
    let mut left = len;
    let mut have = 0u64;
    for s in segs {
        let slen = u64::from(s.len);
        have += slen;
        if left == 0 {
            continue;
        }
        if skip >= slen {
            skip -= slen;
            continue;
        }
        let mut off = skip;
        skip = 0;
        while off < slen && left > 0 {
            let n = (slen - off).min(left).min(max_piece);
            let addr = s.addr.checked_add(off).ok_or(CopyError::Overflow {
                addr: s.addr,
                offset: off,
            })?;
            // n <= u32::MAX fits a usize on every supported (64-bit) host.
            f(addr, n as usize)?;
            off += n;
            left -= n;
        }
    }
    if left != 0 {
        return Err(CopyError::Short {
            want: start.saturating_add(len),
            have,
        }
        .into());
    }
    Ok(())
}

/// The guest address of byte `pos` of the stream `segs` form.
pub fn locate(segs: &[Seg], pos: u64) -> Option<u64> {
    let mut skip = pos;
    for s in segs {
        let l = u64::from(s.len);
        if skip < l {
            return s.addr.checked_add(skip);
        }
        skip -= l;
    }
    None
}

/// Reads `dst.len()` bytes at `start` of the stream `segs` form, through `dma` on behalf of
/// bounce worker `worker` (headers, commands: small transfers). `segs` are buffers of a
/// walked chain: the walker checked them against guest memory, `dma` does not again
/// ([`RangeCheck::Prevalidated`]).
///
/// # Errors
/// [`CopyError`].
pub fn copy_from<M: GuestMemory + ?Sized>(
    dma: &Dma,
    mem: &M,
    worker: usize,
    segs: &[Seg],
    start: u64,
    dst: &mut [u8],
) -> Result<(), CopyError> {
    let mut done = 0usize;
    for_each_piece(segs, start, dst.len() as u64, u64::MAX, |addr, n| {
        dma.read_guest(
            mem,
            addr,
            &mut dst[done..done + n],
            worker,
            RangeCheck::Prevalidated,
        )?;
        done += n;
        Ok::<(), CopyError>(())
    })
}

/// Writes `src` at `start` of the stream `segs` form, through `dma` (status bytes, ids,
/// acks: small transfers). As [`copy_from`], the walker's check of `segs` is the one.
///
/// # Errors
/// [`CopyError`].
pub fn copy_to<M: GuestMemory + ?Sized>(
    dma: &Dma,
    mem: &M,
    worker: usize,
    segs: &[Seg],
    start: u64,
    src: &[u8],
) -> Result<(), CopyError> {
    let mut done = 0usize;
    for_each_piece(segs, start, src.len() as u64, u64::MAX, |addr, n| {
        dma.write_guest(
            mem,
            addr,
            &src[done..done + n],
            worker,
            RangeCheck::Prevalidated,
        )?;
        done += n;
        Ok::<(), CopyError>(())
    })
}

/// Size of a split descriptor, checked against the type virtio-queue reads.
const _: () = assert!(size_of::<Descriptor>() == DESC_SIZE as usize);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::GuestRam;
    use crate::virtio::driver::{write_table_desc, Desc};

    const N: u16 = VRING_DESC_F_NEXT;
    const W: u16 = VRING_DESC_F_WRITE;
    const I: u16 = VRING_DESC_F_INDIRECT;

    struct T {
        ram: GuestRam,
        table: u64,
        size: u16,
    }

    impl T {
        fn new(size: u16) -> Self {
            let mut ram = GuestRam::new(1 << 20);
            let table = ram.alloc(16 * u64::from(size), 16);
            Self { ram, table, size }
        }
        fn put(&self, table: u64, descs: &[(u64, u32, u16, u16)]) {
            for (i, &(addr, len, flags, next)) in (0u16..).zip(descs) {
                let d = Desc {
                    addr,
                    len,
                    flags,
                    next,
                };
                write_table_desc(self.ram.mem(), table, i, d).unwrap();
            }
        }
        fn walk(&self, rules: WalkRules) -> (Result<(), ChainError>, Chain) {
            let mut c = Chain::default();
            let at = ChainHead {
                head: 0,
                desc_table: self.table,
                queue_size: self.size,
            };
            (walk(self.ram.mem(), &at, &rules, &mut c), c)
        }
    }

    const RULES: WalkRules = WalkRules {
        indirect: true,
        max_indirect: 256,
    };

    #[test]
    fn a_direct_chain_splits_by_direction() {
        let t = T::new(8);
        t.put(
            t.table,
            &[
                (0x8000, 16, N, 1),
                (0x9000, 512, N | W, 2),
                (0xa000, 1, W, 0),
            ],
        );
        let (r, c) = t.walk(RULES);
        r.unwrap();
        assert!(c.is_complete());
        assert_eq!(
            c.readable,
            vec![Seg {
                addr: 0x8000,
                len: 16
            }]
        );
        assert_eq!((c.readable_len, c.writable_len), (16, 513));
        assert_eq!(c.last_writable_byte(), Some(0xa000));
    }

    #[test]
    fn zero_length_descriptors_are_refused_but_the_chain_stays_enumerable() {
        let t = T::new(8);
        t.put(
            t.table,
            &[(0x8000, 16, N, 1), (0x9000, 0, N | W, 2), (0xa000, 1, W, 0)],
        );
        let (r, c) = t.walk(RULES);
        assert_eq!(r, Err(ChainError::ZeroLength));
        assert!(!ChainError::ZeroLength.is_structural());
        assert!(c.is_complete());
        assert_eq!(
            c.writable,
            vec![Seg {
                addr: 0xa000,
                len: 1
            }]
        );
        assert_eq!(c.last_writable_byte(), Some(0xa000));
    }

    #[test]
    fn structural_errors_end_the_walk() {
        let t = T::new(4);
        // A loop.
        t.put(t.table, &[(0x8000, 16, N, 1), (0x9000, 16, N, 0)]);
        let (r, c) = t.walk(RULES);
        assert_eq!(r, Err(ChainError::Loop));
        assert!(!c.is_complete() && c.last_writable_byte().is_none());
        // A bad next index.
        t.put(t.table, &[(0x8000, 16, N, 9)]);
        assert_eq!(
            t.walk(RULES).0,
            Err(ChainError::IndexOutOfRange {
                index: 9,
                table_len: 4
            })
        );
        // Indirect: not negotiated, with NEXT, bad length, too long, nested.
        t.put(t.table, &[(0x10000, 32, I, 0)]);
        let no_ind = WalkRules {
            indirect: false,
            ..RULES
        };
        assert_eq!(t.walk(no_ind).0, Err(ChainError::IndirectNotNegotiated));
        t.put(t.table, &[(0x10000, 32, I | N, 1)]);
        assert_eq!(t.walk(RULES).0, Err(ChainError::IndirectWithNext));
        t.put(t.table, &[(0x10000, 17, I, 0)]);
        assert_eq!(
            t.walk(RULES).0,
            Err(ChainError::BadIndirectLength { len: 17 })
        );
        t.put(t.table, &[(0x10000, 16 * 257, I, 0)]);
        assert!(matches!(
            t.walk(RULES).0,
            Err(ChainError::IndirectTooLong { entries: 257, .. })
        ));
        t.put(t.table, &[(0x10000, 32, I, 0)]);
        t.put(0x10000, &[(0x11000, 16, I, 0)]);
        assert_eq!(t.walk(RULES).0, Err(ChainError::NestedIndirect));
        // A table outside guest memory.
        t.put(t.table, &[(1 << 30, 32, I, 0)]);
        assert!(matches!(
            t.walk(RULES).0,
            Err(ChainError::TableOutsideMemory { .. })
        ));
    }

    #[test]
    fn an_indirect_table_may_be_longer_than_the_ring() {
        // A 128-entry ring, a 256-entry table (header, 254 data buffers, status): the
        // device's maximum bounds it, not the ring.
        let t = T::new(128);
        let table = 0x20000;
        let mut descs = vec![(0x8000, 16, N, 1)];
        for i in 1..255u16 {
            descs.push((0x30000 + 512 * u64::from(i), 512, N | W, i + 1));
        }
        descs.push((0xa000, 1, W, 0));
        t.put(table, &descs);
        t.put(t.table, &[(table, 16 * 256, I, 0)]);
        let (r, c) = t.walk(RULES);
        r.unwrap();
        assert_eq!((c.readable.len(), c.writable.len()), (1, 255));
        // An indirect loop is still caught, within the table's length.
        t.put(table, &[(0x8000, 16, N, 1), (0x8000, 16, N, 0)]);
        t.put(t.table, &[(table, 32, I, 0)]);
        assert_eq!(t.walk(RULES).0, Err(ChainError::Loop));
    }

    #[test]
    fn content_errors_are_reported_after_the_whole_walk() {
        let t = T::new(8);
        t.put(
            t.table,
            &[
                (0x8000, 16, N, 1),
                (0x9000, 16, N | W, 2),
                (0xa000, 16, N, 3),
                (1 << 30, 16, N | W, 4),
                (0xb000, 1, W, 0),
            ],
        );
        let (r, c) = t.walk(RULES);
        assert_eq!(r, Err(ChainError::ReadableAfterWritable));
        assert!(c.is_complete());
        assert_eq!(c.last_writable_byte(), Some(0xb000));
        assert_eq!(c.writable.len(), 2, "the buffer outside memory is left out");
        // A refused descriptor after the last writable one: the status is lost.
        for last in [(0xb000, 0, W, 0), (1 << 30, 1, W, 0), (0xb000, 1, 0, 0)] {
            t.put(t.table, &[(0x8000, 16, N, 1), (0x9000, 16, N | W, 2), last]);
            let (r, c) = t.walk(RULES);
            assert!(r.is_err() && c.is_complete(), "{last:?}");
            assert_eq!(c.last_writable_byte(), None, "{last:?}");
        }
    }

    #[test]
    fn streams_copy_across_buffers_and_refuse_short_ones() {
        let ram = GuestRam::new(1 << 20);
        let segs = [
            Seg {
                addr: 0x1000,
                len: 3,
            },
            Seg {
                addr: 0x2000,
                len: 5,
            },
        ];
        let dma = Dma::direct();
        copy_to(&dma, ram.mem(), 0, &segs, 1, &[1, 2, 3, 4]).unwrap();
        assert_eq!(ram.read(0x1000, 3), vec![0, 1, 2]);
        assert_eq!(ram.read(0x2000, 2), vec![3, 4]);
        let mut b = [0u8; 4];
        copy_from(&dma, ram.mem(), 0, &segs, 1, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3, 4]);
        assert_eq!(
            copy_from(&dma, ram.mem(), 0, &segs, 6, &mut b),
            Err(CopyError::Short { want: 10, have: 8 })
        );
        assert_eq!(locate(&segs, 3), Some(0x2000));
        assert_eq!(locate(&segs, 8), None);
    }
}
