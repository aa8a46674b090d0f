//! A Linux tap device with vnet headers: the backend of a queue pair.
//!
//! The tap is opened `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR` (plus `IFF_MULTI_QUEUE` when the
//! device has more than one queue pair, one [`Tap`] per queue), non-blocking. The vnet header
//! size is set to 12 bytes (`virtio_net_hdr_v1`), and the offloads the tap may hand us
//! (TUNSETOFFLOAD) are derived from the features the guest **acked** only
//! ([`offload_flags`]), never from what the device offered.

use std::ffi::c_int;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use smallvec::SmallVec;
use vm_memory::VolatileSlice;
use vmm_sys_util::ioctl::{ioctl_with_mut_ref, ioctl_with_ref, ioctl_with_val};

use super::{Error, Result, VNET_HDR_LEN};
use crate::virtio::spec::{
    feature, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6,
};

/// The tun ioctl numbers (`<linux/if_tun.h>`), computed by vmm-sys-util's macros.
mod sys {
    use std::ffi::{c_int, c_uint};
    use vmm_sys_util::{ioctl_ior_nr, ioctl_iow_nr};

    const TUNTAP: u32 = 0x54;
    ioctl_iow_nr!(TUNSETIFF, TUNTAP, 202, c_int);
    ioctl_ior_nr!(TUNGETIFF, TUNTAP, 210, c_uint);
    ioctl_iow_nr!(TUNSETOFFLOAD, TUNTAP, 208, c_uint);
    ioctl_iow_nr!(TUNSETVNETHDRSZ, TUNTAP, 216, c_int);
    ioctl_iow_nr!(TUNSETQUEUE, TUNTAP, 217, c_int);
}
/// Largest iovec count of one `writev` (Linux `UIO_MAXIOV`).
const UIO_MAXIOV: usize = 1024;

use sys::{TUNGETIFF, TUNSETIFF, TUNSETOFFLOAD, TUNSETQUEUE, TUNSETVNETHDRSZ};

// Linux if_tun.h values: constants, alike in shape only to other tables.
const IFF_TAP: i16 = 0x0002;
const IFF_NO_PI: i16 = 0x1000;
const IFF_VNET_HDR: i16 = 0x4000;
const IFF_MULTI_QUEUE: i16 = 0x0100;
const IFF_ATTACH_QUEUE: i16 = 0x0200;
const IFF_DETACH_QUEUE: i16 = 0x0400;

/// TUNSETOFFLOAD: the tap may hand us frames with a partial checksum.
pub const TUN_F_CSUM: u32 = 0x01;
/// TUNSETOFFLOAD: the tap may hand us TSOv4 frames.
pub const TUN_F_TSO4: u32 = 0x02;
/// TUNSETOFFLOAD: the tap may hand us TSOv6 frames.
pub const TUN_F_TSO6: u32 = 0x04;

const IFNAMSIZ: usize = 16;

/// `struct ifreq` as TUNSETIFF/TUNGETIFF use it: a name and a flags word (40 bytes in all).
#[repr(C)]
#[derive(Clone, Copy)]
struct IfReq {
    name: [u8; IFNAMSIZ],
    flags: i16,
    _pad: [u8; 22],
}

/// The TUNSETOFFLOAD flags allowed by the features the guest acked (receive direction: what
/// the tap may give us to deliver). TSO needs GUEST_CSUM too (virtio 1.2 5.1.3.1, and the tap
/// refuses TSO without CSUM); ECN and UFO are never offered, so never set.
pub fn offload_flags(acked: u64) -> u32 {
    if acked & feature(VIRTIO_NET_F_GUEST_CSUM) == 0 {
        return 0;
    }
    let mut f = TUN_F_CSUM;
    if acked & feature(VIRTIO_NET_F_GUEST_TSO4) != 0 {
        f |= TUN_F_TSO4;
    }
    if acked & feature(VIRTIO_NET_F_GUEST_TSO6) != 0 {
        f |= TUN_F_TSO6;
    }
    f
}

/// One queue of a tap device.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
}

impl Tap {
    /// The name to pass to [`Tap::open`] for a new tap the kernel names (`tap0`, `tap1`, ...;
    /// what QEMU's `-netdev tap` without `ifname=` does). [`Tap::name`] then gives the name.
    pub const KERNEL_NAMED: &'static str = "tap%d";

    fn err(name: &str, reason: impl Into<String>) -> Error {
        Error::Tap {
            name: name.to_string(),
            reason: reason.into(),
        }
    }

    /// The error of an ioctl `what()` that returned `ret` (negative: the OS error), if any.
    fn check(&self, ret: c_int, what: impl FnOnce() -> String) -> Result<()> {
        if ret < 0 {
            let e = io::Error::last_os_error();
            return Err(Self::err(&self.name, format!("{}: {e}", what())));
        }
        Ok(())
    }

    /// Opens `queues` queues of the tap `name` (creating it if it does not exist and the
    /// caller may), each non-blocking with 12-byte vnet headers and no offloads yet.
    ///
    /// # Errors
    /// [`Error::Tap`] with a one-line reason: `/dev/net/tun` missing, permission denied, a
    /// bad name, or a tap that exists with other flags.
    pub fn open(name: &str, queues: usize) -> Result<Vec<Tap>> {
        if name.is_empty() || name.len() >= IFNAMSIZ || name.contains(['/', ' ', '\0']) {
            return Err(Self::err(name, "invalid interface name"));
        }
        if queues == 0 || queues > usize::from(super::MAX_QUEUE_PAIRS) {
            return Err(Self::err(name, format!("invalid queue count {queues}")));
        }
        let mut flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR;
        if queues > 1 {
            flags |= IFF_MULTI_QUEUE;
        }
        // The first open resolves a kernel-named template; the other queues attach to it.
        let first = Self::open_one(name, flags)?;
        let resolved = first.name.clone();
        let mut taps = vec![first];
        for _ in 1..queues {
            taps.push(Self::open_one(&resolved, flags)?);
        }
        Ok(taps)
    }

    fn open_one(name: &str, flags: i16) -> Result<Tap> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => Self::err(name, "/dev/net/tun does not exist"),
                io::ErrorKind::PermissionDenied => {
                    Self::err(name, "permission denied opening /dev/net/tun")
                }
                _ => Self::err(name, format!("opening /dev/net/tun: {e}")),
            })?;
        let mut req = IfReq {
            name: [0; IFNAMSIZ],
            flags,
            _pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: `file` is an open tun fd; TUNSETIFF reads a `struct ifreq` and writes the
        // interface's name back into it; `req` is a 40-byte repr(C) struct with the name and
        // flags where the kernel expects them.
        let ret = unsafe { ioctl_with_mut_ref(&file, TUNSETIFF(), &mut req) };
        if ret < 0 {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EPERM) | Some(libc::EACCES) => Self::err(
                    name,
                    "permission denied (need CAP_NET_ADMIN, or a tap owned by this user)",
                ),
                Some(libc::EBUSY) => Self::err(
                    name,
                    "busy: exists with other flags (multi_queue/vnet_hdr) or is in use",
                ),
                Some(libc::EINVAL) => Self::err(name, "exists and is not a tap with these flags"),
                _ => Self::err(name, format!("TUNSETIFF: {e}")),
            });
        }
        // The kernel's name (differs from `name` for a template such as "tap%d").
        let len = req.name.iter().position(|&b| b == 0).unwrap_or(IFNAMSIZ);
        let tap = Tap {
            file,
            name: String::from_utf8_lossy(&req.name[..len]).into_owned(),
        };
        tap.set_vnet_hdr_size(VNET_HDR_LEN)?;
        tap.set_offload(0)?;
        Ok(tap)
    }

    /// The interface name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The flags the kernel reports for this tap (TUNGETIFF).
    ///
    /// # Errors
    /// [`Error::Tap`] when the ioctl fails.
    pub fn flags(&self) -> Result<i16> {
        let mut req = IfReq {
            name: [0; IFNAMSIZ],
            flags: 0,
            _pad: [0; 22],
        };
        // SAFETY: TUNGETIFF writes a `struct ifreq` into `req`, a 40-byte repr(C) struct that
        // lives for the call.
        let ret = unsafe { ioctl_with_mut_ref(&self.file, TUNGETIFF(), &mut req) };
        self.check(ret, || "TUNGETIFF".into())?;
        Ok(req.flags)
    }

    /// Sets the vnet header size (TUNSETVNETHDRSZ).
    ///
    /// # Errors
    /// [`Error::Tap`] when the kernel refuses.
    pub fn set_vnet_hdr_size(&self, size: usize) -> Result<()> {
        let size = c_int::try_from(size).map_err(|_| Self::err(&self.name, "bad header size"))?;
        // SAFETY: TUNSETVNETHDRSZ reads one int from the pointer; `size` lives for the call.
        let ret = unsafe { ioctl_with_ref(&self.file, TUNSETVNETHDRSZ(), &size) };
        self.check(ret, || "TUNSETVNETHDRSZ".into())
    }

    /// Sets the receive offloads (TUNSETOFFLOAD, `TUN_F_*`). Pass [`offload_flags`] of the
    /// acked features.
    ///
    /// # Errors
    /// [`Error::Tap`] when the kernel refuses (e.g. TSO without CSUM).
    pub fn set_offload(&self, flags: u32) -> Result<()> {
        // SAFETY: TUNSETOFFLOAD takes its argument by value; no memory is passed.
        let ret = unsafe { ioctl_with_val(&self.file, TUNSETOFFLOAD(), flags.into()) };
        self.check(ret, || format!("TUNSETOFFLOAD {flags:#x}"))
    }

    /// Attaches this queue to, or detaches it from, the tap's steering (TUNSETQUEUE); a
    /// detached queue receives nothing. Only for multi-queue taps.
    ///
    /// # Errors
    /// [`Error::Tap`] when the kernel refuses.
    pub fn set_queue_enabled(&self, enabled: bool) -> Result<()> {
        let mut req = IfReq {
            name: [0; IFNAMSIZ],
            flags: if enabled {
                IFF_ATTACH_QUEUE
            } else {
                IFF_DETACH_QUEUE
            },
            _pad: [0; 22],
        };
        req.name[..self.name.len()].copy_from_slice(self.name.as_bytes());
        // SAFETY: TUNSETQUEUE reads a `struct ifreq` (only its flags); `req` is a 40-byte
        // repr(C) struct that lives for the call.
        let ret = unsafe { ioctl_with_ref(&self.file, TUNSETQUEUE(), &req) };
        if ret < 0 {
            let e = io::Error::last_os_error();
            // Attaching an attached queue or detaching a detached one is EINVAL: not an error
            // for us, the state is what was asked.
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(Self::err(&self.name, format!("TUNSETQUEUE: {e}")));
            }
        }
        Ok(())
    }

    /// Reads one frame (vnet header first) into `buf`; `WouldBlock` when there is none.
    ///
    /// # Errors
    /// The read's I/O error.
    pub fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.file.read(buf)
    }

    /// Writes one frame (vnet header first) with one `write`.
    ///
    /// # Errors
    /// The write's I/O error; a short write is `WriteZero`.
    pub fn write_frame(&mut self, frame: &[u8]) -> io::Result<()> {
        let n = self.file.write(frame)?;
        if n != frame.len() {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "short tap write"));
        }
        Ok(())
    }

    /// Writes one frame given as its vnet header and the pieces of the rest with one
    /// `writev`, straight from where the pieces are (a tap takes one frame per write, so
    /// this saves the copy into a host buffer, not the system call). A frame of more
    /// pieces than `writev` takes is gathered first.
    ///
    /// # Errors
    /// The write's I/O error; a short write is `WriteZero`.
    pub fn write_frame_slices(
        &mut self,
        head: &[u8],
        body: &[VolatileSlice<'_>],
    ) -> io::Result<()> {
        let mut iov: SmallVec<[libc::iovec; 8]> = SmallVec::new();
        let mut total = 0usize;
        for (ptr, len) in std::iter::once((head.as_ptr(), head.len()))
            .chain(body.iter().map(|s| (s.ptr_guard().as_ptr(), s.len())))
        {
            if len == 0 {
                continue;
            }
            iov.push(libc::iovec {
                iov_base: ptr.cast_mut().cast(),
                iov_len: len,
            });
            total += len;
        }
        if iov.len() > UIO_MAXIOV {
            return self.write_frame(&super::backend::gather_frame(head, body));
        }
        // SAFETY: a writev wrapper. Every iovec names memory valid for reads for the length
        // of the call: `head` and the volatile slices (whose owners keep them mapped while
        // they are borrowed here); the kernel only reads them. iov.len() <= UIO_MAXIOV fits
        // a c_int.
        let n = unsafe {
            libc::writev(
                self.file.as_raw_fd(),
                iov.as_ptr(),
                iov.len() as libc::c_int,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != total {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "short tap write"));
        }
        Ok(())
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::spec::{VIRTIO_NET_F_CSUM, VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6};

    #[test]
    fn offloads_follow_acked_guest_features_only() {
        assert_eq!(offload_flags(0), 0);
        // Host-side features never turn tap offloads on.
        assert_eq!(
            offload_flags(
                feature(VIRTIO_NET_F_CSUM)
                    | feature(VIRTIO_NET_F_HOST_TSO4)
                    | feature(VIRTIO_NET_F_HOST_TSO6)
            ),
            0
        );
        assert_eq!(offload_flags(feature(VIRTIO_NET_F_GUEST_CSUM)), TUN_F_CSUM);
        assert_eq!(
            offload_flags(
                feature(VIRTIO_NET_F_GUEST_CSUM)
                    | feature(VIRTIO_NET_F_GUEST_TSO4)
                    | feature(VIRTIO_NET_F_GUEST_TSO6)
            ),
            TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6
        );
        // TSO without GUEST_CSUM would be refused by the tap: nothing is applied.
        assert_eq!(offload_flags(feature(VIRTIO_NET_F_GUEST_TSO4)), 0);
    }

    #[test]
    fn ifreq_is_40_bytes() {
        assert_eq!(std::mem::size_of::<IfReq>(), 40);
    }

    #[test]
    fn bad_names_refused() {
        for n in ["", "a/b", "0123456789abcdef"] {
            assert!(matches!(Tap::open(n, 1), Err(Error::Tap { .. })));
        }
    }
}
