//! What a front end's control messages must satisfy before the backend acts on them.
//!
//! `vhost-user-backend` takes a message's word for more than the device can live with: it
//! acknowledges a queue size that is not a power of two and keeps the old one (the device then
//! wrote used entries past the end of the driver's ring), maps a region larger than the file
//! behind it (the first access past the file's end is a SIGBUS that kills the process), refuses
//! a memory table whose regions are not in ascending address order (the spec asks for no
//! order), and reads and writes kick, call and error fds of any kind as if they were eventfds,
//! blocking on a pipe or on an eventfd whose counter is full while holding locks the end of the
//! session needs. The relay runs these checks on every message that carries such values, and
//! refuses the message (the session ends, as `vhost-user-backend` ends it on its own errors)
//! instead of forwarding it:
//! - [`vring_num`]: a split-ring size is a power of two between 1 and the device's maximum
//!   (the device offers no packed rings);
//! - [`vring_fd`]: a kick, call or error fd is an eventfd; it is switched to non-blocking, so
//!   consuming a kick that another reader took and signalling a counter that is already full
//!   return at once instead of blocking (a full counter is already readable: the front end
//!   sees the notification either way);
//! - [`mem_table`]: each region is non-empty, does not wrap, and fits inside its file
//!   (`fstat`: a regular file, memfds and hugetlbfs included, must hold `mmap_offset + size`
//!   bytes; a character device is left to `mmap`; anything else is refused); the regions are
//!   sorted by guest address, their fds with them;
//! - [`add_mem_reg`]: the region of an `ADD_MEM_REG` (`CONFIGURE_MEM_SLOTS`), checked as one of
//!   a table (overlap with the regions already added is refused by `vm-memory`).

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;

/// Bytes of the SET_MEM_TABLE header (region count, padding).
const MEM_TABLE_HEADER: usize = 8;
/// Bytes of one region (guest address, size, user address, mmap offset; little-endian u64s).
const REGION_LEN: usize = 32;
/// Bytes of the ADD_MEM_REG header (padding) before its one region.
const SINGLE_REGION_HEADER: usize = 8;
/// What `readlink("/proc/self/fd/N")` answers for an eventfd.
const EVENTFD_LINK: &str = "anon_inode:[eventfd]";

/// Why a message is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CheckError {
    /// SET_VRING_NUM with a size the device cannot use.
    #[error("queue size {num} is not a power of two between 1 and {max}")]
    QueueSize {
        /// The size asked for.
        num: u32,
        /// The device's largest queue size.
        max: usize,
    },
    /// A kick, call or error fd that is not an eventfd.
    #[error("the {what} fd is not an eventfd ({kind})")]
    NotAnEventFd {
        /// kick, call or error.
        what: &'static str,
        /// What it is instead (the `/proc/self/fd` link, or why it could not be read).
        kind: String,
    },
    /// A kick, call or error eventfd that could not be made non-blocking.
    #[error("the {what} eventfd cannot be made non-blocking: {errno}")]
    NonBlocking {
        /// kick, call or error.
        what: &'static str,
        /// The errno of `fcntl`.
        errno: i32,
    },
    /// A memory table whose body does not match its region count, or whose fds do not.
    #[error("memory table of {regions} regions in a {body}-byte body with {fds} fds")]
    MalformedTable {
        /// The region count of the header.
        regions: u64,
        /// The body's length.
        body: usize,
        /// The fds attached.
        fds: usize,
    },
    /// A region that is empty or whose guest or user range wraps around.
    #[error("region {index} ({gpa:#x}+{size:#x}, user {uaddr:#x}) is empty or wraps")]
    BadRegion {
        /// Position in the table as sent.
        index: usize,
        /// Guest physical address.
        gpa: u64,
        /// Size.
        size: u64,
        /// Front end's address.
        uaddr: u64,
    },
    /// A region reaching past the end of its file.
    #[error(
        "region {index} maps {size:#x} bytes at offset {offset:#x} of a {file_size:#x}-byte file"
    )]
    PastEndOfFile {
        /// Position in the table as sent.
        index: usize,
        /// Size.
        size: u64,
        /// Offset in the file.
        offset: u64,
        /// The file's size (`fstat`).
        file_size: u64,
    },
    /// An ADD_MEM_REG of a new region while every memory slot is taken.
    #[error("a region added while all {max} memory slots are taken")]
    NoFreeSlot {
        /// The slot count (`GET_MAX_MEM_SLOTS`).
        max: usize,
    },
    /// A region whose fd cannot back guest memory (a pipe, a socket, a directory, a block
    /// device), or whose `fstat` failed.
    #[error("region {index}'s fd cannot be mapped as guest memory ({kind})")]
    NotMappable {
        /// Position in the table as sent.
        index: usize,
        /// What the fd is.
        kind: String,
    },
}

/// SET_VRING_NUM: `num` must be a power of two in `1..=max`.
///
/// # Errors
/// [`CheckError::QueueSize`].
pub fn vring_num(num: u32, max: usize) -> Result<(), CheckError> {
    let fits = usize::try_from(num).is_ok_and(|n| n <= max);
    if num.is_power_of_two() && fits {
        Ok(())
    } else {
        Err(CheckError::QueueSize { num, max })
    }
}

/// SET_VRING_KICK/CALL/ERR: `fd` must be an eventfd; it is made non-blocking (the flag is on
/// the file description the front end shares: QEMU and libblkio create them non-blocking).
///
/// # Errors
/// [`CheckError::NotAnEventFd`], [`CheckError::NonBlocking`].
pub fn vring_fd(what: &'static str, fd: &OwnedFd) -> Result<(), CheckError> {
    let raw = fd.as_raw_fd();
    let link = std::fs::read_link(format!("/proc/self/fd/{raw}"));
    match link {
        Ok(l) if l.as_os_str() == EVENTFD_LINK => {}
        Ok(l) => {
            return Err(CheckError::NotAnEventFd {
                what,
                kind: l.to_string_lossy().into_owned(),
            })
        }
        Err(e) => {
            return Err(CheckError::NotAnEventFd {
                what,
                kind: format!("/proc/self/fd/{raw}: {e}"),
            })
        }
    }
    set_nonblocking(fd).map_err(|errno| CheckError::NonBlocking { what, errno })
}

/// Adds O_NONBLOCK to `fd`'s file status flags; the errno on failure.
fn set_nonblocking(fd: &OwnedFd) -> Result<(), i32> {
    let raw = fd.as_raw_fd();
    // SAFETY: F_GETFL on a descriptor `fd` owns; no memory is passed.
    let flags = unsafe { libc::fcntl(raw, libc::F_GETFL) };
    if flags < 0 {
        return Err(errno());
    }
    // SAFETY: F_SETFL on a descriptor `fd` owns, with an integer argument.
    if unsafe { libc::fcntl(raw, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(errno());
    }
    Ok(())
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// One region of a memory table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Guest physical address.
    pub gpa: u64,
    /// Size in bytes.
    pub size: u64,
    /// The front end's address of the region.
    pub uaddr: u64,
    /// Offset of the region in its file.
    pub offset: u64,
}

impl Region {
    /// Decodes the 32 little-endian bytes of a region.
    fn decode(b: &[u8]) -> Option<Self> {
        let word = |i: usize| -> Option<u64> {
            let at = i.checked_mul(8)?;
            Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
        };
        Some(Self {
            gpa: word(0)?,
            size: word(1)?,
            uaddr: word(2)?,
            offset: word(3)?,
        })
    }

    /// Checks the region against the file `fd` that backs it (`index` names it in errors).
    ///
    /// # Errors
    /// [`CheckError::BadRegion`], [`CheckError::PastEndOfFile`], [`CheckError::NotMappable`].
    pub fn check(&self, index: usize, fd: &OwnedFd) -> Result<(), CheckError> {
        let wraps = self.gpa.checked_add(self.size).is_none()
            || self.uaddr.checked_add(self.size).is_none();
        if self.size == 0 || wraps {
            return Err(CheckError::BadRegion {
                index,
                gpa: self.gpa,
                size: self.size,
                uaddr: self.uaddr,
            });
        }
        let not_mappable = |kind: String| CheckError::NotMappable { index, kind };
        let meta = fd
            .try_clone()
            .map(File::from)
            .and_then(|f| f.metadata())
            .map_err(|e| not_mappable(format!("fstat: {e}")))?;
        let ft = meta.file_type();
        if ft.is_file() {
            let past = |file_size| CheckError::PastEndOfFile {
                index,
                size: self.size,
                offset: self.offset,
                file_size,
            };
            match self.offset.checked_add(self.size) {
                Some(end) if end <= meta.len() => Ok(()),
                _ => Err(past(meta.len())),
            }
        } else if ft.is_char_device() {
            // Device memory (/dev/dax, /dev/zero): mmap itself refuses what it cannot map.
            Ok(())
        } else {
            let kind = if ft.is_dir() {
                "a directory"
            } else if ft.is_fifo() {
                "a pipe"
            } else if ft.is_socket() {
                "a socket"
            } else if ft.is_block_device() {
                "a block device"
            } else {
                "not a file"
            };
            Err(not_mappable(kind.to_string()))
        }
    }
}

/// SET_MEM_TABLE: checks every region against its fd and sorts the regions (and their fds)
/// by guest address, in place.
///
/// # Errors
/// [`CheckError::MalformedTable`] when the body or the fds do not match the region count,
/// and what [`Region::check`] finds.
pub fn mem_table(body: &mut [u8], fds: &mut Vec<OwnedFd>) -> Result<(), CheckError> {
    let count = body
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes);
    let (body_len, fd_count) = (body.len(), fds.len());
    let malformed = || CheckError::MalformedTable {
        regions: count.map_or(0, u64::from),
        body: body_len,
        fds: fd_count,
    };
    let n = count
        .and_then(|c| usize::try_from(c).ok())
        .ok_or_else(malformed)?;
    let expected = n
        .checked_mul(REGION_LEN)
        .and_then(|r| r.checked_add(MEM_TABLE_HEADER));
    if expected != Some(body_len) || fd_count != n {
        return Err(malformed());
    }
    let table = &mut body[MEM_TABLE_HEADER..];
    let mut regions = Vec::with_capacity(n);
    for (index, (raw, fd)) in table.chunks_exact(REGION_LEN).zip(fds.iter()).enumerate() {
        let r = Region::decode(raw).ok_or_else(malformed)?;
        r.check(index, fd)?;
        regions.push((r.gpa, raw.to_vec(), index));
    }
    regions.sort_by_key(|&(gpa, _, _)| gpa);
    let mut by_index: Vec<Option<OwnedFd>> = fds.drain(..).map(Some).collect();
    for ((_, raw, index), out) in regions.into_iter().zip(table.chunks_exact_mut(REGION_LEN)) {
        out.copy_from_slice(&raw);
        if let Some(fd) = by_index.get_mut(index).and_then(Option::take) {
            fds.push(fd);
        }
    }
    Ok(())
}

/// ADD_MEM_REG: its one region, checked against its one fd, and returned.
///
/// # Errors
/// [`CheckError::MalformedTable`] when the body is not one region or there is not one fd, and
/// what [`Region::check`] finds.
pub fn add_mem_reg(body: &[u8], fds: &[OwnedFd]) -> Result<Region, CheckError> {
    let malformed = || CheckError::MalformedTable {
        regions: 1,
        body: body.len(),
        fds: fds.len(),
    };
    let region = single_region(body).ok_or_else(malformed)?;
    match fds {
        [fd] => region.check(0, fd).map(|()| region),
        _ => Err(malformed()),
    }
}

/// The one region of an `ADD_MEM_REG` or `REM_MEM_REG` body; `None` when the body is not
/// one region.
pub fn single_region(body: &[u8]) -> Option<Region> {
    body.get(SINGLE_REGION_HEADER..)
        .filter(|r| r.len() == REGION_LEN)
        .and_then(Region::decode)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::FromRawFd;

    fn memfd(size: u64) -> OwnedFd {
        let name = c"checks-test";
        // SAFETY: memfd_create reads the NUL-terminated name; the fd it returns is ours.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: `fd` was just created and nothing else owns it.
        let f = unsafe { File::from_raw_fd(fd) };
        f.set_len(size).unwrap();
        f.into()
    }

    /// A pipe: (read end, write end).
    fn pipe() -> (OwnedFd, OwnedFd) {
        let mut fds = [-1; 2];
        // SAFETY: pipe2 writes two descriptors into the two-element array.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both were just created and nothing else owns them.
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    fn table(regions: &[Region]) -> Vec<u8> {
        let mut b = (regions.len() as u32).to_le_bytes().to_vec();
        b.extend_from_slice(&[0; 4]);
        for r in regions {
            for v in [r.gpa, r.size, r.uaddr, r.offset] {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        b
    }

    fn region(gpa: u64, size: u64) -> Region {
        Region {
            gpa,
            size,
            uaddr: 0x7000_0000_0000u64.wrapping_add(gpa),
            offset: 0,
        }
    }

    #[test]
    fn queue_sizes_are_powers_of_two_up_to_the_maximum() {
        for ok in [1, 2, 64, 256] {
            assert_eq!(vring_num(ok, 256), Ok(()), "{ok}");
        }
        for bad in [0, 3, 100, 255, 512, 65536, u32::MAX] {
            assert!(vring_num(bad, 256).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_eventfds_are_kick_call_or_error_fds_and_they_become_non_blocking() {
        // SAFETY: eventfd takes no pointers; the fd it returns is ours.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: `raw` was just created and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let mut original = File::from(fd.try_clone().unwrap());
        vring_fd("call", &fd).unwrap();
        // The flag is on the shared description: a read of the empty counter fails at once
        // instead of blocking.
        let mut b = [0u8; 8];
        let err = std::io::Read::read(&mut original, &mut b).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::WouldBlock);
        let (r, w) = pipe();
        File::from(w).write_all(&[1]).unwrap();
        let err = vring_fd("kick", &r).unwrap_err();
        assert!(err.to_string().contains("pipe:"), "{err}");
        let (s, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(vring_fd("err", &OwnedFd::from(s)).is_err());
        assert!(vring_fd("call", &memfd(8)).is_err());
    }

    #[test]
    fn regions_past_their_file_are_refused_and_order_does_not_matter() {
        let mib = 1 << 20;
        // Listed high region first: sorted, with the fds following their regions.
        let (lo, hi) = (memfd(mib), memfd(2 * mib));
        let (lo_raw, hi_raw) = (lo.as_raw_fd(), hi.as_raw_fd());
        let mut body = table(&[region(mib, 2 * mib), region(0, mib)]);
        let mut fds = vec![hi, lo];
        mem_table(&mut body, &mut fds).unwrap();
        assert_eq!(body, table(&[region(0, mib), region(mib, 2 * mib)]));
        assert_eq!(
            fds.iter().map(AsRawFd::as_raw_fd).collect::<Vec<_>>(),
            vec![lo_raw, hi_raw]
        );
        // One byte past the file, at offset 0 or through the offset.
        let mut body = table(&[region(0, mib + 1)]);
        let err = mem_table(&mut body, &mut vec![memfd(mib)]).unwrap_err();
        assert!(
            matches!(err, CheckError::PastEndOfFile { index: 0, .. }),
            "{err}"
        );
        let mut r = region(0, mib);
        r.offset = 4096;
        let err = mem_table(&mut table(&[r]), &mut vec![memfd(mib)]).unwrap_err();
        assert!(matches!(err, CheckError::PastEndOfFile { .. }), "{err}");
        r.offset = u64::MAX - 4095;
        assert!(mem_table(&mut table(&[r]), &mut vec![memfd(mib)]).is_err());
        // Empty, wrapping, and fds that cannot be guest memory.
        for bad in [region(0, 0), region(u64::MAX - 4095, 8192)] {
            let err = mem_table(&mut table(&[bad]), &mut vec![memfd(mib)]).unwrap_err();
            assert!(matches!(err, CheckError::BadRegion { .. }), "{err}");
        }
        let (p, _w) = pipe();
        let err = mem_table(&mut table(&[region(0, 4096)]), &mut vec![p]).unwrap_err();
        assert!(matches!(err, CheckError::NotMappable { .. }), "{err}");
        // Counts that disagree with the body or the fds.
        let mut body = table(&[region(0, 4096)]);
        assert!(mem_table(&mut body, &mut vec![]).is_err());
        assert!(mem_table(&mut body[..20], &mut vec![memfd(mib)]).is_err());
        assert!(mem_table(&mut [], &mut vec![]).is_err());
    }

    #[test]
    fn an_added_region_is_checked_as_one_of_a_table() {
        let mib = 1 << 20;
        let single = |r: Region| {
            let mut b = vec![0; SINGLE_REGION_HEADER];
            b.extend_from_slice(&table(&[r])[MEM_TABLE_HEADER..]);
            b
        };
        assert_eq!(
            add_mem_reg(&single(region(0, mib)), &[memfd(mib)]),
            Ok(region(0, mib))
        );
        let err = add_mem_reg(&single(region(0, mib + 1)), &[memfd(mib)]).unwrap_err();
        assert!(matches!(err, CheckError::PastEndOfFile { .. }), "{err}");
        assert!(add_mem_reg(&single(region(0, 0)), &[memfd(mib)]).is_err());
        assert!(add_mem_reg(&single(region(0, 4096)), &[]).is_err());
        assert!(add_mem_reg(&single(region(0, 4096))[..39], &[memfd(mib)]).is_err());
    }
}
