//! Crash-durability checks shared by the SIGKILL tests of `bouncevm-vhost`
//! (`vmm/vhost/tests/blk_crash.rs`) and `bouncevm` (`vmm/tests/vm_crash.rs`): the images
//! (raw, or qcow2 made by `qemu-img create`), the data each numbered write carries and where
//! it lands, and the read-back after the kill (`qemu-img check` first for qcow2, then
//! `qemu-img convert -O raw`).
//!
//! A SIGKILL leaves the host page cache intact, so data that only reached the page cache
//! reads back fine although a host crash would lose it. [`read_back`] therefore also checks
//! that no page of the image is still dirty in the page cache (`/proc/kpageflags`, root):
//! what was acknowledged as durable must have been written back (fdatasync) already.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The size of every crash-test image.
pub const IMAGE_SIZE: u64 = 64 << 20;
/// qcow2 cluster size of the crash-test images: small, so that writes spread over the image
/// allocate data clusters, L2 tables (one per 2 MiB of guest space) and refcount entries.
pub const QCOW2_CLUSTER: u64 = 4096;

/// Where write `i` lands (bytes): 3 MiB + 512 B apart, so each write starts inside a cluster
/// (a partial, allocating write) in a new L2 table's range of a [`QCOW2_CLUSTER`] image.
pub fn crash_offset(i: u64) -> u64 {
    i * (3 << 20) + 512 * (i + 1)
}

/// The bytes of write `i`.
pub fn crash_pattern(i: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|b| ((b * 13 + i * 71 + 5) % 251) as u8)
        .collect()
}

/// A fresh, empty image of [`IMAGE_SIZE`] at `path` (`raw` or `qcow2`).
pub fn create_image(path: &Path, format: &str) {
    let _ = std::fs::remove_file(path);
    match format {
        "raw" => std::fs::File::create(path)
            .unwrap()
            .set_len(IMAGE_SIZE)
            .unwrap(),
        "qcow2" => {
            run(Command::new("qemu-img")
                .args(["create", "-q", "-f", "qcow2", "-o"])
                .arg(format!("cluster_size={QCOW2_CLUSTER}"))
                .arg(path)
                .arg(IMAGE_SIZE.to_string()));
        }
        f => panic!("unknown format {f}"),
    }
}

/// Runs `cmd`, which must succeed; returns its stdout.
///
/// # Panics
/// When it cannot be started or fails (its output is in the message).
pub fn run(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap();
    assert!(
        o.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The guest-visible contents of the image after the crash. A qcow2 image must first pass
/// `qemu-img check` (no corruption, no leaked cluster), then is read by `qemu-img convert`.
pub fn read_back(path: &Path, format: &str, what: &str) -> Vec<u8> {
    match dirty_pages(path) {
        Ok(dirty) => assert!(
            dirty.is_empty(),
            "{what}: {} page(s) of the image still dirty in the host page cache (not synced), \
             first at byte {:#x}",
            dirty.len(),
            dirty[0] * PAGE
        ),
        Err(e) => bounce::testing::missing(
            bounce::testing::Resource::Root,
            &format!("cannot read page flags to check the image was synced ({e})"),
        ),
    }
    if format == "raw" {
        return std::fs::read(path).unwrap();
    }
    qemu_img_check(path, &[0], "qemu-img check failed", what);
    let raw = PathBuf::from(format!("{}.converted.raw", path.display()));
    run(Command::new("qemu-img")
        .args(["convert", "-U", "-O", "raw"])
        .arg(path)
        .arg(&raw));
    let data = std::fs::read(&raw).unwrap();
    std::fs::remove_file(&raw).unwrap();
    data
}

/// `qemu-img check` finds no corruption in `path`: at most leaked clusters (status 3), what
/// QEMU leaves when it is killed between allocating clusters and referencing them.
pub fn assert_consistent(path: &Path, what: &str) {
    qemu_img_check(path, &[0, 3], "qemu-img check found corruption", what);
}

/// Runs `qemu-img check` on `path`; its status must be one of `allowed`.
fn qemu_img_check(path: &Path, allowed: &[i32], failure: &str, what: &str) {
    let check = Command::new("qemu-img")
        .args(["check", "-U"])
        .arg(path)
        .output()
        .unwrap();
    let code = check.status.code();
    assert!(
        code.is_some_and(|c| allowed.contains(&c)),
        "{what}: {failure} (status {code:?}): {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
}

/// Every write in `acked` (write numbers of `len` bytes each) is in `data`.
pub fn assert_acknowledged(data: &[u8], acked: &[u64], len: usize, what: &str) {
    assert!(!acked.is_empty(), "{what}: nothing was acknowledged");
    for &i in acked {
        let at = usize::try_from(crash_offset(i)).unwrap();
        assert!(
            data.get(at..at + len) == Some(&crash_pattern(i, len)[..]),
            "{what}: acknowledged write {i} (offset {at}) lost"
        );
    }
}

const PAGE: u64 = 4096;
/// `KPF_DIRTY` in /proc/kpageflags (Documentation/admin-guide/mm/pagemap.rst).
const KPF_DIRTY: u64 = 1 << 4;

/// The pages of `path` that are dirty in the host page cache: each resident page is mapped,
/// its frame found through /proc/self/pagemap and its flags read from /proc/kpageflags.
fn dirty_pages(path: &Path) -> std::io::Result<Vec<u64>> {
    let file = File::open(path)?;
    let len = usize::try_from(file.metadata()?.len()).map_err(std::io::Error::other)?;
    if len == 0 {
        return Ok(Vec::new());
    }
    let pagemap = File::open("/proc/self/pagemap")?;
    let kpageflags = File::open("/proc/kpageflags")?;
    let map = Mapping::new(&file, len)?;
    let mut dirty = Vec::new();
    for (i, resident) in map.resident()?.into_iter().enumerate() {
        if !resident {
            continue;
        }
        let i = i as u64;
        let page = map.touch(i);
        let mut e = [0u8; 8];
        pagemap.read_exact_at(&mut e, page / PAGE * 8)?;
        let e = u64::from_le_bytes(e);
        let pfn = e & ((1 << 55) - 1);
        if e >> 63 == 0 {
            continue; // dropped from the cache meanwhile: not dirty
        }
        if pfn == 0 {
            return Err(std::io::Error::other(
                "/proc/self/pagemap hides frames (not root)",
            ));
        }
        let mut f = [0u8; 8];
        kpageflags.read_exact_at(&mut f, pfn * 8)?;
        if u64::from_le_bytes(f) & KPF_DIRTY != 0 {
            dirty.push(i);
        }
    }
    Ok(dirty)
}

/// A read-only shared mapping of a whole file.
struct Mapping {
    addr: *mut libc::c_void,
    len: usize,
}

impl Mapping {
    fn new(file: &File, len: usize) -> std::io::Result<Self> {
        // SAFETY: a new read-only shared mapping of an open file; nothing else is mapped at
        // the address the kernel picks, and Drop unmaps it.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { addr, len })
    }

    /// Which pages are in the page cache (mincore).
    fn resident(&self) -> std::io::Result<Vec<bool>> {
        let mut v = vec![0u8; self.len.div_ceil(PAGE as usize)];
        // SAFETY: `v` has one byte per page of the mapping, as mincore requires.
        let rc = unsafe { libc::mincore(self.addr, self.len, v.as_mut_ptr()) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(v.into_iter().map(|b| b & 1 != 0).collect())
    }

    /// Maps page `i` into the page table by reading one byte; returns its virtual address.
    fn touch(&self, i: u64) -> u64 {
        let off = usize::try_from(i * PAGE).unwrap();
        assert!(off < self.len);
        // SAFETY: `off` is inside the mapping; a volatile read of one byte of a file page.
        unsafe { std::ptr::read_volatile(self.addr.cast::<u8>().add(off)) };
        self.addr as u64 + off as u64
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `new` created.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}
