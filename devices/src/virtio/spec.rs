//! The virtio vocabulary of the tree: feature bits, ring flags, device ids and status, block
//! request types and status, net header and control values, and the structures whose sizes and
//! field offsets are the wire layout, by the names the specification and Linux give them.
//!
//! Every value comes from `virtio-bindings` (bindgen output of the Linux uapi headers) and is
//! re-exported here, so the tree has one place to import the vocabulary from and no number
//! written twice. The bindings give every constant as a `u32`:
//! - feature bits stay bit numbers, as the bindings and the specification give them;
//!   [`feature`] turns one into its mask in the 64-bit feature word;
//! - constants the wire holds in a narrower field (ring flags are le16, device status, block
//!   status and the net header's flags are bytes) are re-typed here, once, with the bindings'
//!   name, through [`le16`] and [`byte`]: a value that does not fit fails the build.
//!
//! The layout structures ([`virtio_blk_config`], [`virtio_net_config`], [`virtio_blk_outhdr`],
//! [`virtio_net_hdr_v1`], [`vring_desc`]) are there for `size_of` and `offset_of!`; the tree
//! reads and writes those fields as little-endian bytes, never through the structures.

use virtio_bindings::bindings::{virtio_blk, virtio_config, virtio_net, virtio_ring};

pub use virtio_bindings::bindings::virtio_blk::{
    virtio_blk_config, virtio_blk_discard_write_zeroes, virtio_blk_outhdr, VIRTIO_BLK_F_BLK_SIZE,
    VIRTIO_BLK_F_CONFIG_WCE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_MQ,
    VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX, VIRTIO_BLK_F_WRITE_ZEROES,
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID,
    VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
    VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
pub use virtio_bindings::bindings::virtio_config::{
    VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1,
};
pub use virtio_bindings::bindings::virtio_net::{
    virtio_net_config, virtio_net_hdr_v1, VIRTIO_NET_F_CSUM, VIRTIO_NET_F_CTRL_GUEST_OFFLOADS,
    VIRTIO_NET_F_CTRL_RX, VIRTIO_NET_F_CTRL_VQ, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_ECN,
    VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6, VIRTIO_NET_F_GUEST_UFO,
    VIRTIO_NET_F_HOST_ECN, VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6, VIRTIO_NET_F_HOST_UFO,
    VIRTIO_NET_F_MAC, VIRTIO_NET_F_MQ, VIRTIO_NET_F_MRG_RXBUF, VIRTIO_NET_F_MTU,
    VIRTIO_NET_F_SPEED_DUPLEX, VIRTIO_NET_F_STATUS,
};
pub use virtio_bindings::bindings::virtio_ring::{
    vring_desc, vring_used_elem, VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
    VRING_AVAIL_ALIGN_SIZE, VRING_DESC_ALIGN_SIZE, VRING_USED_ALIGN_SIZE,
};
pub use virtio_bindings::virtio_ids::{VIRTIO_ID_BLOCK, VIRTIO_ID_NET};

/// The mask of feature bit `bit` in the 64-bit feature word.
pub const fn feature(bit: u32) -> u64 {
    assert!(bit < 64, "feature bits are numbered 0..64");
    1 << bit
}

/// `v` as the le16 field that holds it (ring flags, the net status word).
pub const fn le16(v: u32) -> u16 {
    assert!(v <= u16::MAX as u32, "value does not fit a 16-bit field");
    v as u16
}

/// `v` as the byte that holds it (device status, block status, net header and control fields).
pub const fn byte(v: u32) -> u8 {
    assert!(v <= u8::MAX as u32, "value does not fit a byte");
    v as u8
}

/// Descriptor flag: the chain continues at `next`.
pub const VRING_DESC_F_NEXT: u16 = le16(virtio_ring::VRING_DESC_F_NEXT);
/// Descriptor flag: the device writes this buffer.
pub const VRING_DESC_F_WRITE: u16 = le16(virtio_ring::VRING_DESC_F_WRITE);
/// Descriptor flag: the buffer is a table of descriptors.
pub const VRING_DESC_F_INDIRECT: u16 = le16(virtio_ring::VRING_DESC_F_INDIRECT);
/// Available ring flag: the driver does not want interrupts (without EVENT_IDX).
pub const VRING_AVAIL_F_NO_INTERRUPT: u16 = le16(virtio_ring::VRING_AVAIL_F_NO_INTERRUPT);
/// Used ring flag: the device does not want kicks (without EVENT_IDX).
pub const VRING_USED_F_NO_NOTIFY: u16 = le16(virtio_ring::VRING_USED_F_NO_NOTIFY);

/// Device status: the guest found the device.
pub const VIRTIO_CONFIG_S_ACKNOWLEDGE: u8 = byte(virtio_config::VIRTIO_CONFIG_S_ACKNOWLEDGE);
/// Device status: the guest knows how to drive it.
pub const VIRTIO_CONFIG_S_DRIVER: u8 = byte(virtio_config::VIRTIO_CONFIG_S_DRIVER);
/// Device status: the driver is ready.
pub const VIRTIO_CONFIG_S_DRIVER_OK: u8 = byte(virtio_config::VIRTIO_CONFIG_S_DRIVER_OK);
/// Device status: feature negotiation is complete.
pub const VIRTIO_CONFIG_S_FEATURES_OK: u8 = byte(virtio_config::VIRTIO_CONFIG_S_FEATURES_OK);
/// Device status: the device hit an error it cannot recover from without a reset.
pub const VIRTIO_CONFIG_S_NEEDS_RESET: u8 = byte(virtio_config::VIRTIO_CONFIG_S_NEEDS_RESET);
/// Device status: the guest gave up on the device.
pub const VIRTIO_CONFIG_S_FAILED: u8 = byte(virtio_config::VIRTIO_CONFIG_S_FAILED);

/// Block request status: success.
pub const VIRTIO_BLK_S_OK: u8 = byte(virtio_blk::VIRTIO_BLK_S_OK);
/// Block request status: device or driver error.
pub const VIRTIO_BLK_S_IOERR: u8 = byte(virtio_blk::VIRTIO_BLK_S_IOERR);
/// Block request status: the request is not supported.
pub const VIRTIO_BLK_S_UNSUPP: u8 = byte(virtio_blk::VIRTIO_BLK_S_UNSUPP);

/// Net status word: the link is up.
pub const VIRTIO_NET_S_LINK_UP: u16 = le16(virtio_net::VIRTIO_NET_S_LINK_UP);

/// Net header `flags`: the checksum must be completed from `csum_start` at `csum_offset`.
pub const VIRTIO_NET_HDR_F_NEEDS_CSUM: u8 = byte(virtio_net::VIRTIO_NET_HDR_F_NEEDS_CSUM);
/// Net header `flags`: the checksum was verified (receive only).
pub const VIRTIO_NET_HDR_F_DATA_VALID: u8 = byte(virtio_net::VIRTIO_NET_HDR_F_DATA_VALID);
/// Net header `gso_type`: not a GSO frame.
pub const VIRTIO_NET_HDR_GSO_NONE: u8 = byte(virtio_net::VIRTIO_NET_HDR_GSO_NONE);
/// Net header `gso_type`: TCP over IPv4.
pub const VIRTIO_NET_HDR_GSO_TCPV4: u8 = byte(virtio_net::VIRTIO_NET_HDR_GSO_TCPV4);
/// Net header `gso_type`: UDP fragmentation offload.
pub const VIRTIO_NET_HDR_GSO_UDP: u8 = byte(virtio_net::VIRTIO_NET_HDR_GSO_UDP);
/// Net header `gso_type`: TCP over IPv6.
pub const VIRTIO_NET_HDR_GSO_TCPV6: u8 = byte(virtio_net::VIRTIO_NET_HDR_GSO_TCPV6);
/// Net header `gso_type`: UDP segmentation (USO).
pub const VIRTIO_NET_HDR_GSO_UDP_L4: u8 = byte(virtio_net::VIRTIO_NET_HDR_GSO_UDP_L4);
/// Net header `gso_type` modifier: TCP with ECN.
pub const VIRTIO_NET_HDR_GSO_ECN: u8 = byte(virtio_net::VIRTIO_NET_HDR_GSO_ECN);

/// Net control class: receive filtering.
pub const VIRTIO_NET_CTRL_RX: u8 = byte(virtio_net::VIRTIO_NET_CTRL_RX);
/// Net control class: MAC filtering.
pub const VIRTIO_NET_CTRL_MAC: u8 = byte(virtio_net::VIRTIO_NET_CTRL_MAC);
/// Net control class: multiqueue.
pub const VIRTIO_NET_CTRL_MQ: u8 = byte(virtio_net::VIRTIO_NET_CTRL_MQ);
/// Net control MAC command: set the filter table.
pub const VIRTIO_NET_CTRL_MAC_TABLE_SET: u8 = byte(virtio_net::VIRTIO_NET_CTRL_MAC_TABLE_SET);
/// Net control MQ command: set the number of queue pairs.
pub const VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET: u8 = byte(virtio_net::VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET);
/// Net control ack: success.
pub const VIRTIO_NET_OK: u8 = byte(virtio_net::VIRTIO_NET_OK);
/// Net control ack: failure.
pub const VIRTIO_NET_ERR: u8 = byte(virtio_net::VIRTIO_NET_ERR);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrowed_values_are_the_specifications() {
        assert_eq!(
            (VRING_DESC_F_NEXT, VRING_DESC_F_WRITE, VRING_DESC_F_INDIRECT),
            (1, 2, 4)
        );
        assert_eq!(VIRTIO_CONFIG_S_NEEDS_RESET, 0x40);
        assert_eq!(
            (VIRTIO_BLK_S_OK, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_UNSUPP),
            (0, 1, 2)
        );
        assert_eq!(VIRTIO_NET_HDR_GSO_ECN, 0x80);
        assert_eq!(feature(VIRTIO_F_VERSION_1), 1 << 32);
        assert_eq!(feature(VIRTIO_NET_F_SPEED_DUPLEX), 1 << 63);
    }

    #[test]
    fn layout_structures_have_the_wire_sizes() {
        use std::mem::{offset_of, size_of};
        assert_eq!(size_of::<vring_desc>(), 16);
        assert_eq!(size_of::<vring_used_elem>(), 8);
        assert_eq!(size_of::<virtio_blk_outhdr>(), 16);
        assert_eq!(size_of::<virtio_blk_discard_write_zeroes>(), 16);
        assert_eq!(size_of::<virtio_net_hdr_v1>(), 12);
        assert_eq!(size_of::<virtio_net_config>(), 24);
        assert_eq!(offset_of!(virtio_blk_config, wce), 32);
        assert_eq!(offset_of!(virtio_blk_config, num_queues), 34);
    }
}
