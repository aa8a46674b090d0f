//! Property test of qcow2 images with hostile headers and metadata:
//! images made by `qemu-img` (64 KiB, 4 KiB and 512-byte clusters, v2 and v3, 1-bit
//! refcounts, lazy refcounts, a backing file; data written by `qemu-img convert`) get random
//! header fields (every field of the v3 header, at its width), L1 / L2 / refcount-table
//! entries, header-extension and backing-name bytes, or arbitrary bytes replaced with edge
//! values (0, 1, all ones, the file size and its neighbours, other fields' values so tables
//! overlap, 2^63, random); some name the image itself as their backing file.
//!
//! Oracle: opening it (`Qcow2Disk::open`, read-write) gives an error or a disk; on a disk, a
//! block device serves 4 KiB reads at the start and the end, a write and its read-back, and a
//! flush, each completing with OK or IOERR, and a write that succeeded reads back as written.
//! No panic; every case finishes within 20 s (a hang fails it); the process runs under a
//! 4 GiB address-space limit, so an allocation sized by a hostile field aborts the test
//! instead of passing unnoticed.
//!
//! A stack overflow aborts the process before proptest can record the case:
//! `BVM_QCOW2_FUZZ_TRACE=1` prints each case (and keeps the last image as `last.qcow2` in the
//! work directory) to find it. `BVM_FUZZ_CASES` (default 256) and `BVM_FUZZ_SEED` as for `blk_fuzz`
//! ([`bounce::testing::fuzz_config`]); a longer run:
//! `BVM_FUZZ_CASES=10000 BVM_FUZZ_SEED=random cargo test --release -p devices --test qcow2_fuzz`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::Duration;

use bounce::Dma;
use common::*;
use devices::block::io::Qcow2Disk;
use devices::block::BlockConfig;
use devices::testing::durable::run;
use devices::virtio::spec::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK};
use proptest::prelude::*;

/// The v3 header's fields: (offset, width in bytes).
const FIELDS: [(usize, usize); 20] = [
    (0, 4),   // magic
    (4, 4),   // version
    (8, 8),   // backing_file_offset
    (16, 4),  // backing_file_size
    (20, 4),  // cluster_bits
    (24, 8),  // size
    (32, 4),  // crypt_method
    (36, 4),  // l1_size
    (40, 8),  // l1_table_offset
    (48, 8),  // refcount_table_offset
    (56, 4),  // refcount_table_clusters
    (60, 4),  // nb_snapshots
    (64, 8),  // snapshots_offset
    (72, 8),  // incompatible_features
    (80, 8),  // compatible_features
    (88, 8),  // autoclear_features
    (96, 4),  // refcount_order
    (100, 4), // header_length
    (104, 1), // compression_type
    (112, 8), // the first header extension (type, length)
];

/// Base images: (name, bytes).
type Bases = Vec<(String, Vec<u8>)>;

/// The base images, made once; `None` (reported as a skip for the calling test) without
/// qemu-img.
fn bases() -> Option<&'static [(String, Vec<u8>)]> {
    static BASES: OnceLock<Option<Bases>> = OnceLock::new();
    thread_local!(static REPORTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    let b = BASES.get_or_init(make_bases).as_deref();
    if b.is_none() && !REPORTED.replace(true) {
        bounce::testing::missing(
            bounce::testing::Resource::QemuImg,
            "qemu-img is not installed (apt-get install qemu-utils)",
        );
    }
    b
}

fn make_bases() -> Option<Bases> {
    let qi = "qemu-img";
    Command::new(qi)
        .arg("--version")
        .output()
        .ok()?
        .status
        .success()
        .then_some(())?;
    let dir = workdir();
    let raw = dir.join("data.raw");
    let mut data = pattern(3, 1 << 20);
    data[256 << 10..].fill(0);
    std::fs::write(&raw, &data).unwrap();
    let variants: [(&str, &[&str]); 6] = [
        ("64k", &[]),
        ("4k", &["-o", "cluster_size=4096"]),
        ("512", &["-o", "cluster_size=512"]),
        ("v2", &["-o", "compat=0.10"]),
        (
            "rc1-lazy",
            &["-o", "refcount_bits=1,lazy_refcounts=on,cluster_size=4096"],
        ),
        (
            "backed",
            &["-b", "data.raw", "-F", "raw", "-o", "cluster_size=4096"],
        ),
    ];
    let mut out = Vec::new();
    for (name, opts) in variants {
        let img = dir.join(format!("{name}.qcow2"));
        let _ = std::fs::remove_file(&img);
        if name == "backed" {
            run(Command::new(qi)
                .current_dir(&dir)
                .args(["create", "-q", "-f", "qcow2"])
                .args(opts)
                .arg(&img)
                .arg("1M"));
        } else {
            run(Command::new(qi)
                .args(["convert", "-q", "-f", "raw", "-O", "qcow2"])
                .args(opts)
                .arg(&raw)
                .arg(&img));
        }
        out.push((name.to_string(), std::fs::read(&img).unwrap()));
    }
    Some(out)
}

fn workdir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("bouncevm-qcow2-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Where a mutation lands.
#[derive(Clone, Debug)]
enum At {
    /// A header field (index into [`FIELDS`]).
    Field(u8),
    /// An L1 entry.
    L1(u16),
    /// An entry of the first L2 table.
    L2(u16),
    /// A refcount-table entry.
    Refcount(u16),
    /// A byte range after the fixed header (extensions, backing name), 8 bytes wide.
    Ext(u16),
    /// Any 8 bytes of the file (per mille of its length).
    Raw(u16),
    /// The image names itself as its backing file.
    BackingSelf,
}

/// What is written there.
#[derive(Clone, Debug)]
enum Val {
    Zero,
    One,
    Ones,
    /// The file length plus -2..=2.
    FileLen(i8),
    /// A cluster-aligned offset near the end of the file, plus a small skew.
    NearEnd(u8, u8),
    /// The current value of another header field (tables overlap).
    Field(u8),
    Huge,
    /// The current value with one bit flipped.
    Flip(u8),
    Any(u64),
}

fn at() -> impl Strategy<Value = At> {
    prop_oneof![
        6 => (0u8..FIELDS.len() as u8).prop_map(At::Field),
        2 => (0u16..64).prop_map(At::L1),
        2 => (0u16..512).prop_map(At::L2),
        2 => (0u16..64).prop_map(At::Refcount),
        1 => (0u16..256).prop_map(At::Ext),
        1 => (0u16..1000).prop_map(At::Raw),
        1 => Just(At::BackingSelf),
    ]
}

fn val() -> impl Strategy<Value = Val> {
    prop_oneof![
        1 => Just(Val::Zero),
        1 => Just(Val::One),
        1 => Just(Val::Ones),
        1 => (-2i8..=2).prop_map(Val::FileLen),
        1 => (0u8..4, any::<u8>()).prop_map(|(c, s)| Val::NearEnd(c, s)),
        1 => (0u8..FIELDS.len() as u8).prop_map(Val::Field),
        1 => Just(Val::Huge),
        1 => (0u8..64).prop_map(Val::Flip),
        2 => any::<u64>().prop_map(Val::Any),
    ]
}

/// The file offset of entry `i` of a table at `table` (saturating: tables may be anywhere).
fn entry(table: u64, i: u16) -> usize {
    usize::try_from(table.saturating_add(8 * u64::from(i))).unwrap_or(usize::MAX)
}

fn be(bytes: &[u8], off: usize, width: usize) -> u64 {
    bytes
        .get(off..off.saturating_add(width))
        .map_or(0, |b| b.iter().fold(0u64, |v, &x| (v << 8) | u64::from(x)))
}

fn put_be(bytes: &mut Vec<u8>, off: usize, width: usize, v: u64) {
    if bytes.len() < off + width {
        bytes.resize(off + width, 0);
    }
    for i in 0..width {
        bytes[off + i] = (v >> (8 * (width - 1 - i))) as u8;
    }
}

/// Applies one mutation to `img`.
fn mutate(img: &mut Vec<u8>, a: &At, v: &Val, self_name: &str) {
    let cluster_bits = be(img, 20, 4).min(30);
    let cluster = 1u64 << cluster_bits.max(9);
    let len = img.len() as u64;
    let (off, width) = match *a {
        At::Field(i) => FIELDS[usize::from(i)],
        At::L1(i) => (entry(be(img, 40, 8), i), 8),
        At::L2(i) => {
            let l1 = usize::try_from(be(img, 40, 8)).unwrap_or(usize::MAX);
            (entry(be(img, l1, 8) & 0x00ff_ffff_ffff_fe00, i), 8)
        }
        At::Refcount(i) => (entry(be(img, 48, 8), i), 8),
        At::Ext(o) => (104 + usize::from(o), 8),
        At::Raw(p) => ((img.len() * usize::from(p) / 1000).saturating_sub(8), 8),
        At::BackingSelf => {
            // At the end of the first cluster (or its first 4 KiB), after the extensions.
            let name = self_name.as_bytes();
            let end = (cluster as usize).min(4096) - 8;
            let at = end - name.len();
            img[at..end].copy_from_slice(name);
            put_be(img, 8, 8, at as u64);
            put_be(img, 16, 4, name.len() as u64);
            return;
        }
    };
    // Offsets read from the image may be anywhere: stay within the file (and 1 MiB).
    if off >= img.len().max(1 << 20) {
        return;
    }
    let cur = be(img, off, width);
    let x = match *v {
        Val::Zero => 0,
        Val::One => 1,
        Val::Ones => u64::MAX,
        Val::FileLen(d) => len.wrapping_add_signed(i64::from(d)),
        Val::NearEnd(c, s) => {
            (len / cluster)
                .saturating_sub(u64::from(c))
                .saturating_mul(cluster)
                + u64::from(s % 3)
        }
        Val::Field(i) => {
            let (o, w) = FIELDS[usize::from(i)];
            be(img, o, w)
        }
        Val::Huge => 1 << 62,
        Val::Flip(b) => cur ^ (1 << (u32::from(b) % (8 * width as u32))),
        Val::Any(x) => x,
    };
    let x = if width < 8 {
        x & ((1 << (8 * width)) - 1)
    } else {
        x
    };
    put_be(img, off, width, x);
}

/// Opens `path` and exercises it through a block device. Returns what happened, or `Err`
/// when a write that succeeded read back differently.
fn exercise(path: &Path, seed: u64) -> Result<String, String> {
    let disk = match Qcow2Disk::open(path, false) {
        Err(e) => {
            let msg = e.to_string();
            assert!(!msg.is_empty(), "an open error without a message");
            return Ok(format!("refused: {msg}"));
        }
        Ok(d) => d,
    };
    let cap = devices::block::Disk::capacity(&disk);
    let mut blk = match devices::block::Block::new(disk, BlockConfig::default(), Dma::direct()) {
        Err(e) => return Ok(format!("device refused ({cap} bytes): {e}")),
        Ok(dev) => {
            let mut drv = devices::testing::TestDriver::new(dev, RAM);
            drv.negotiate(u64::MAX);
            drv.activate(64).expect("activate");
            Blk { drv }
        }
    };
    let sectors = cap / 512;
    let ok_or_err = |st: u8, what: &str| {
        assert!(
            st == VIRTIO_BLK_S_OK || st == VIRTIO_BLK_S_IOERR,
            "{what}: status {st}"
        );
        st == VIRTIO_BLK_S_OK
    };
    let mut log = format!("capacity {cap}");
    let n = 8u64.min(sectors);
    let r = blk.read(0, 512 * n as u32, Layout::Simple);
    ok_or_err(r.status, "read at 0");
    let last = sectors - n;
    let r = blk.read(last, 512 * n as u32, Layout::Simple);
    ok_or_err(r.status, "read at the end");
    let at = seed % (sectors - n + 1);
    let data = pattern(seed, 512 * n as usize);
    let w = blk.write(at, &data, Layout::Simple);
    let wrote = ok_or_err(w.status, "write");
    let r = blk.read(at, 512 * n as u32, Layout::Simple);
    let read = ok_or_err(r.status, "read back");
    let f = blk.flush();
    ok_or_err(f, "flush");
    if wrote && read && r.data != data {
        return Err(format!(
            "sector {at}: a write that succeeded reads back wrong"
        ));
    }
    log += &format!(", write {wrote}, read back {read}, flush {f}");
    Ok(log)
}

/// Runs `exercise` on its own thread: a panic fails the case, and so does a hang.
fn guarded(path: PathBuf, seed: u64) -> Result<String, String> {
    let (tx, rx) = mpsc::channel();
    let t = std::thread::spawn(move || {
        let r = exercise(&path, seed);
        let _ = tx.send(());
        r
    });
    match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => match t.join() {
            Ok(r) => r,
            Err(p) => std::panic::resume_unwind(p),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("the image hangs open or I/O (20 s)"),
    }
}

/// Caps the address space, so an allocation sized by a hostile field fails loudly (abort)
/// instead of succeeding lazily under overcommit.
fn limit_address_space() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let lim = libc::rlimit {
            rlim_cur: 4 << 30,
            rlim_max: libc::RLIM_INFINITY,
        };
        // SAFETY: setrlimit reads the struct we pass; no memory is handed over.
        let rc = unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) };
        assert_eq!(rc, 0, "setrlimit: {}", std::io::Error::last_os_error());
    });
}

fn run_case(base: usize, muts: &[(At, Val)], seed: u64) {
    let Some(bases) = bases() else { return };
    limit_address_space();
    let (name, bytes) = &bases[base % bases.len()];
    let path = workdir().join(format!("case-{:?}.qcow2", std::thread::current().id()));
    let self_name = path.file_name().unwrap().to_str().unwrap().to_string();
    let mut img = bytes.clone();
    for (a, v) in muts {
        mutate(&mut img, a, v, &self_name);
    }
    std::fs::write(&path, &img).unwrap();
    if std::env::var_os("BVM_QCOW2_FUZZ_TRACE").is_some() {
        // Stack overflows abort the process before proptest can record the case.
        eprintln!("CASE {name} {muts:?} {seed}");
        std::fs::write(workdir().join("last.qcow2"), &img).unwrap();
    }
    let outcome = guarded(path.clone(), seed);
    if let Err(e) = outcome {
        // Wrong data is a failure on an image QEMU calls consistent. On one `qemu-img check`
        // reports corrupt (e.g. refcounts that say metadata clusters are free), imago, which
        // has no metadata overlap checks, may overwrite its own tables: counted, not failed.
        std::fs::write(&path, &img).unwrap();
        let st = Command::new("qemu-img")
            .args(["check", "-q", "-f", "qcow2"])
            .arg(&path)
            .output()
            .unwrap()
            .status;
        let consistent = matches!(st.code(), Some(0 | 3));
        assert!(
            !consistent,
            "{name} {muts:?}: {e} on an image qemu-img check accepts"
        );
        eprintln!("qcow2_fuzz: {e} on an image qemu-img check calls corrupt (tolerated)");
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
fn an_image_without_a_refcount_table_is_refused() {
    // Found by the fuzzer (a stack overflow in imago on the first allocation, which aborts
    // the process, so proptest could not record it): refcount_table_clusters 0.
    let Some(bases) = bases() else { return };
    for (name, bytes) in bases {
        let mut img = bytes.clone();
        mutate(&mut img, &At::Field(10), &Val::Zero, "");
        let path = workdir().join(format!("norefcount-{name}.qcow2"));
        std::fs::write(&path, &img).unwrap();
        let e = Qcow2Disk::open(&path, false).expect_err(name);
        assert!(e.to_string().contains("corrupt qcow2 image"), "{name}: {e}");
        let _ = std::fs::remove_file(&path);
    }
}

#[test]
fn an_image_that_is_its_own_backing_file_is_refused() {
    // Found by the fuzzer: the backing chain loop recursed until the stack overflowed.
    let Some(bases) = bases() else { return };
    // (The backed image names its backing format, raw: itself as raw is no loop.)
    for (name, bytes) in bases.iter().filter(|(n, _)| n != "backed") {
        let mut img = bytes.clone();
        let file = format!("loop-{name}.qcow2");
        mutate(&mut img, &At::BackingSelf, &Val::Zero, &file);
        let path = workdir().join(&file);
        std::fs::write(&path, &img).unwrap();
        let e = guarded_open(path.clone());
        assert!(e.contains("backing chain deeper than"), "{name}: {e}");
        let _ = std::fs::remove_file(&path);
    }
}

/// The open error of `path`, on a thread with the default 2 MiB stack of spawned threads
/// (an I/O thread's, not the test's main thread's).
fn guarded_open(path: PathBuf) -> String {
    std::thread::spawn(move || match Qcow2Disk::open(&path, false) {
        Ok(_) => "opened".to_string(),
        Err(e) => e.to_string(),
    })
    .join()
    .unwrap()
}

proptest! {
    #![proptest_config(bounce::testing::fuzz_config(256))]
    #[test]
    fn hostile_qcow2_images_open_with_an_error_or_serve_correctly(
        base in 0usize..6,
        muts in prop::collection::vec((at(), val()), 1..5),
        seed in any::<u64>(),
    ) {
        run_case(base, &muts, seed);
    }
}
