//! The split virtqueue layout (virtio 1.2, 2.7) as a driver writes it: the bytes of a
//! descriptor, the sizes of the three parts and where their entries are. The one description
//! of the layout for both drivers in this tree: the test driver ([`crate::testing`]) and
//! `bouncevm-load`'s rings.
//!
//! ```text
//! desc  : size * 16 bytes     { addr: u64, len: u32, flags: u16, next: u16 }
//! avail : 4 + 2 * size + 2    { flags: u16, idx: u16, ring: [u16; size], used_event: u16 }
//! used  : 4 + 8 * size + 2    { flags: u16, idx: u16, ring: [{ id: u32, len: u32 }; size], avail_event: u16 }
//! ```

use super::chain::DESC_SIZE;

/// A split-ring descriptor, written as is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Desc {
    /// Buffer address (guest physical).
    pub addr: u64,
    /// Buffer length.
    pub len: u32,
    /// `VRING_DESC_F_*` flags.
    pub flags: u16,
    /// Next descriptor index in the same table.
    pub next: u16,
}

impl Desc {
    /// The 16 bytes of the descriptor as the table holds them.
    pub fn to_bytes(&self) -> [u8; DESC_SIZE as usize] {
        let mut b = [0u8; DESC_SIZE as usize];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..14].copy_from_slice(&self.flags.to_le_bytes());
        b[14..16].copy_from_slice(&self.next.to_le_bytes());
        b
    }
}

/// A used-ring entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Used {
    /// The head of the completed chain, as the device wrote it (not validated here).
    pub id: u32,
    /// Bytes the device says it wrote.
    pub len: u32,
}

/// Bytes of the descriptor table of a queue of `size`.
pub fn desc_table_bytes(size: u16) -> u64 {
    u64::from(size) * DESC_SIZE
}

/// Bytes of the available ring of a queue of `size` (with `used_event`).
pub fn avail_ring_bytes(size: u16) -> u64 {
    6 + 2 * u64::from(size)
}

/// Bytes of the used ring of a queue of `size` (with `avail_event`).
pub fn used_ring_bytes(size: u16) -> u64 {
    6 + 8 * u64::from(size)
}

/// Offset in the available ring of the entry for free-running index `idx`.
pub fn avail_entry(size: u16, idx: u16) -> u64 {
    4 + 2 * u64::from(idx % size)
}

/// Offset in the used ring of the entry for free-running index `idx`.
pub fn used_entry(size: u16, idx: u16) -> u64 {
    4 + 8 * u64::from(idx % size)
}

/// Offset of `used_event` in the available ring.
pub fn used_event(size: u16) -> u64 {
    4 + 2 * u64::from(size)
}

/// Offset of `avail_event` in the used ring.
pub fn avail_event(size: u16) -> u64 {
    4 + 8 * u64::from(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_of_a_queue_of_eight() {
        assert_eq!(
            Desc {
                addr: 0x1122_3344_5566_7788,
                len: 0x99aa_bbcc,
                flags: 3,
                next: 7
            }
            .to_bytes(),
            [0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, 0xcc, 0xbb, 0xaa, 0x99, 3, 0, 7, 0]
        );
        assert_eq!(
            (desc_table_bytes(8), avail_ring_bytes(8), used_ring_bytes(8)),
            (128, 22, 70)
        );
        assert_eq!((avail_entry(8, 9), used_entry(8, 9)), (6, 12));
        assert_eq!((used_event(8), avail_event(8)), (20, 68));
    }
}
