//! The virtio-net header (`struct virtio_net_hdr_v1`, virtio 1.2 5.1.6) and its checks.
//!
//! With VERSION_1 the header is always 12 bytes and ends with `num_buffers`, whether or not
//! MRG_RXBUF was negotiated; the tap is told the same size (TUNSETVNETHDRSZ), so a header read
//! from the guest goes to the tap as is and a header read from the tap goes to the guest with
//! `num_buffers` filled in.
//!
//! The checks here are what stands between a guest and the host kernel's GSO code: a frame
//! whose header asks for an offload the guest never acked, or whose checksum location lies
//! outside the frame, is dropped (and counted) before it reaches the tap.

use super::VNET_HDR_LEN;
use crate::virtio::spec::{
    feature, VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4,
    VIRTIO_NET_F_GUEST_TSO6, VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6,
    VIRTIO_NET_HDR_F_NEEDS_CSUM, VIRTIO_NET_HDR_GSO_ECN, VIRTIO_NET_HDR_GSO_NONE,
    VIRTIO_NET_HDR_GSO_TCPV4, VIRTIO_NET_HDR_GSO_TCPV6,
};

/// Why a header was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    /// A GSO type the device does not know or never offered (UDP, USO, ECN, unknown).
    #[error("unsupported gso_type {0:#x}")]
    UnsupportedGso(u8),
    /// A GSO type whose feature the guest did not ack.
    #[error("gso_type {0:#x} without its feature acked")]
    GsoNotAcked(u8),
    /// A GSO frame with `gso_size` 0.
    #[error("gso frame with gso_size 0")]
    ZeroGsoSize,
    /// NEEDS_CSUM without the checksum feature acked.
    #[error("NEEDS_CSUM without the checksum feature acked")]
    CsumNotAcked,
    /// The checksum field lies outside the frame.
    #[error("checksum at {start}+{offset} outside a frame of {frame_len} bytes")]
    CsumOutOfFrame {
        /// `csum_start`.
        start: u16,
        /// `csum_offset`.
        offset: u16,
        /// Frame length (without the header).
        frame_len: usize,
    },
}

/// A decoded `virtio_net_hdr_v1` (all fields little-endian on the wire).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VnetHeader {
    /// `flags` (NEEDS_CSUM, DATA_VALID).
    pub flags: u8,
    /// `gso_type`.
    pub gso_type: u8,
    /// `hdr_len`: length of the headers to copy into each segment (a hint).
    pub hdr_len: u16,
    /// `gso_size`: segment payload size.
    pub gso_size: u16,
    /// `csum_start`: where checksumming starts.
    pub csum_start: u16,
    /// `csum_offset`: where, from `csum_start`, the checksum goes.
    pub csum_offset: u16,
    /// `num_buffers`: buffers a received frame spans (MRG_RXBUF), 1 otherwise.
    pub num_buffers: u16,
}

impl VnetHeader {
    /// Decodes the 12 wire bytes.
    pub fn from_bytes(b: &[u8; VNET_HDR_LEN]) -> Self {
        let le = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        Self {
            flags: b[0],
            gso_type: b[1],
            hdr_len: le(2),
            gso_size: le(4),
            csum_start: le(6),
            csum_offset: le(8),
            num_buffers: le(10),
        }
    }

    /// Encodes to the 12 wire bytes.
    pub fn to_bytes(&self) -> [u8; VNET_HDR_LEN] {
        let mut b = [0u8; VNET_HDR_LEN];
        b[0] = self.flags;
        b[1] = self.gso_type;
        b[2..4].copy_from_slice(&self.hdr_len.to_le_bytes());
        b[4..6].copy_from_slice(&self.gso_size.to_le_bytes());
        b[6..8].copy_from_slice(&self.csum_start.to_le_bytes());
        b[8..10].copy_from_slice(&self.csum_offset.to_le_bytes());
        b[10..12].copy_from_slice(&self.num_buffers.to_le_bytes());
        b
    }

    /// True for a GSO frame.
    pub fn is_gso(&self) -> bool {
        self.gso_type != VIRTIO_NET_HDR_GSO_NONE
    }

    /// Checks a header the guest sent with a frame of `frame_len` bytes against the features
    /// it acked (virtio 1.2, 5.1.6.2 "Packet Transmission"): the device offers CSUM and
    /// HOST_TSO4/6 only, so ECN, UFO and USO frames are refused, as is any offload the guest
    /// did not ack.
    ///
    /// # Errors
    /// The [`HeaderError`] that names the first problem found.
    pub fn check_tx(&self, acked: u64, frame_len: usize) -> Result<(), HeaderError> {
        if self.gso_type & VIRTIO_NET_HDR_GSO_ECN != 0 {
            return Err(HeaderError::UnsupportedGso(self.gso_type));
        }
        let needed = match self.gso_type {
            VIRTIO_NET_HDR_GSO_NONE => 0,
            VIRTIO_NET_HDR_GSO_TCPV4 => feature(VIRTIO_NET_F_HOST_TSO4),
            VIRTIO_NET_HDR_GSO_TCPV6 => feature(VIRTIO_NET_F_HOST_TSO6),
            other => return Err(HeaderError::UnsupportedGso(other)),
        };
        if acked & needed != needed {
            return Err(HeaderError::GsoNotAcked(self.gso_type));
        }
        if self.is_gso() && self.gso_size == 0 {
            return Err(HeaderError::ZeroGsoSize);
        }
        if self.flags & VIRTIO_NET_HDR_F_NEEDS_CSUM != 0 {
            if acked & feature(VIRTIO_NET_F_CSUM) == 0 {
                return Err(HeaderError::CsumNotAcked);
            }
            // The 2-byte checksum field must lie inside the frame. u16 + u16 + 2 fits a usize.
            let end = usize::from(self.csum_start) + usize::from(self.csum_offset) + 2;
            if end > frame_len {
                return Err(HeaderError::CsumOutOfFrame {
                    start: self.csum_start,
                    offset: self.csum_offset,
                    frame_len,
                });
            }
        }
        Ok(())
    }

    /// Makes a header the tap produced fit for the guest (5.1.6.4): without GUEST_CSUM the
    /// flags must be zero; an offload the guest did not ack (the tap was never told to
    /// produce one, so this is a kernel surprise) is refused. `num_buffers` is set to `n`.
    ///
    /// # Errors
    /// [`HeaderError::GsoNotAcked`], [`HeaderError::CsumNotAcked`].
    pub fn sanitize_rx(&mut self, acked: u64, num_buffers: u16) -> Result<(), HeaderError> {
        let needed = match self.gso_type & !VIRTIO_NET_HDR_GSO_ECN {
            VIRTIO_NET_HDR_GSO_NONE => 0,
            VIRTIO_NET_HDR_GSO_TCPV4 => feature(VIRTIO_NET_F_GUEST_TSO4),
            VIRTIO_NET_HDR_GSO_TCPV6 => feature(VIRTIO_NET_F_GUEST_TSO6),
            other => return Err(HeaderError::UnsupportedGso(other)),
        };
        if self.gso_type & VIRTIO_NET_HDR_GSO_ECN != 0 || acked & needed != needed {
            return Err(HeaderError::GsoNotAcked(self.gso_type));
        }
        if acked & feature(VIRTIO_NET_F_GUEST_CSUM) == 0 {
            if self.flags & VIRTIO_NET_HDR_F_NEEDS_CSUM != 0 {
                return Err(HeaderError::CsumNotAcked);
            }
            self.flags = 0;
        }
        self.num_buffers = num_buffers;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::spec::{
        VIRTIO_NET_HDR_F_DATA_VALID, VIRTIO_NET_HDR_GSO_UDP, VIRTIO_NET_HDR_GSO_UDP_L4,
    };

    const ALL: u64 = feature(VIRTIO_NET_F_CSUM)
        | feature(VIRTIO_NET_F_HOST_TSO4)
        | feature(VIRTIO_NET_F_HOST_TSO6);

    #[test]
    fn round_trip_little_endian() {
        let h = VnetHeader {
            flags: VIRTIO_NET_HDR_F_NEEDS_CSUM,
            gso_type: VIRTIO_NET_HDR_GSO_TCPV6,
            hdr_len: 0x0102,
            gso_size: 1448,
            csum_start: 54,
            csum_offset: 16,
            num_buffers: 3,
        };
        let b = h.to_bytes();
        assert_eq!(b[2..4], [0x02, 0x01]);
        assert_eq!(b[10..12], [3, 0]);
        assert_eq!(VnetHeader::from_bytes(&b), h);
    }

    #[test]
    fn plain_frame_always_passes() {
        assert_eq!(VnetHeader::default().check_tx(0, 60), Ok(()));
    }

    #[test]
    fn tso_needs_its_feature_and_a_size() {
        let mut h = VnetHeader {
            gso_type: VIRTIO_NET_HDR_GSO_TCPV4,
            gso_size: 1448,
            ..Default::default()
        };
        assert_eq!(h.check_tx(ALL, 9000), Ok(()));
        assert_eq!(
            h.check_tx(feature(VIRTIO_NET_F_HOST_TSO6), 9000),
            Err(HeaderError::GsoNotAcked(VIRTIO_NET_HDR_GSO_TCPV4))
        );
        h.gso_size = 0;
        assert_eq!(h.check_tx(ALL, 9000), Err(HeaderError::ZeroGsoSize));
    }

    #[test]
    fn unoffered_gso_types_refused() {
        for t in [
            VIRTIO_NET_HDR_GSO_UDP,
            VIRTIO_NET_HDR_GSO_UDP_L4,
            VIRTIO_NET_HDR_GSO_TCPV4 | VIRTIO_NET_HDR_GSO_ECN,
            0x42,
        ] {
            let h = VnetHeader {
                gso_type: t,
                gso_size: 100,
                ..Default::default()
            };
            assert_eq!(
                h.check_tx(u64::MAX, 9000),
                Err(HeaderError::UnsupportedGso(t))
            );
        }
    }

    #[test]
    fn csum_partial_checked_against_frame() {
        let h = VnetHeader {
            flags: VIRTIO_NET_HDR_F_NEEDS_CSUM,
            csum_start: 34,
            csum_offset: 6,
            ..Default::default()
        };
        assert_eq!(h.check_tx(feature(VIRTIO_NET_F_CSUM), 42), Ok(()));
        assert_eq!(
            h.check_tx(feature(VIRTIO_NET_F_CSUM), 41),
            Err(HeaderError::CsumOutOfFrame {
                start: 34,
                offset: 6,
                frame_len: 41
            })
        );
        assert_eq!(h.check_tx(0, 42), Err(HeaderError::CsumNotAcked));
        let max = VnetHeader {
            flags: VIRTIO_NET_HDR_F_NEEDS_CSUM,
            csum_start: u16::MAX,
            csum_offset: u16::MAX,
            ..Default::default()
        };
        assert!(max.check_tx(feature(VIRTIO_NET_F_CSUM), 65_550).is_err());
    }

    #[test]
    fn rx_header_sanitized() {
        let mut h = VnetHeader {
            flags: VIRTIO_NET_HDR_F_DATA_VALID,
            ..Default::default()
        };
        h.sanitize_rx(0, 1).unwrap();
        assert_eq!(h.flags, 0);
        assert_eq!(h.num_buffers, 1);
        let mut h = VnetHeader {
            flags: VIRTIO_NET_HDR_F_DATA_VALID,
            ..Default::default()
        };
        h.sanitize_rx(feature(VIRTIO_NET_F_GUEST_CSUM), 4).unwrap();
        assert_eq!((h.flags, h.num_buffers), (VIRTIO_NET_HDR_F_DATA_VALID, 4));
        let mut tso = VnetHeader {
            flags: VIRTIO_NET_HDR_F_NEEDS_CSUM,
            gso_type: VIRTIO_NET_HDR_GSO_TCPV4,
            gso_size: 1448,
            ..Default::default()
        };
        assert!(tso
            .sanitize_rx(feature(VIRTIO_NET_F_GUEST_CSUM), 1)
            .is_err());
        assert!(tso
            .sanitize_rx(
                feature(VIRTIO_NET_F_GUEST_CSUM) | feature(VIRTIO_NET_F_GUEST_TSO4),
                1
            )
            .is_ok());
        let mut partial = VnetHeader {
            flags: VIRTIO_NET_HDR_F_NEEDS_CSUM,
            ..Default::default()
        };
        assert_eq!(partial.sanitize_rx(0, 1), Err(HeaderError::CsumNotAcked));
    }
}
