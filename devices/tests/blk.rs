//! Functional tests of virtio-blk through the test driver: every request type and feature,
//! with bounce off and forced (swiotlb and iova, several allocators), data checked byte for
//! byte against the backing file; raw and qcow2 images.

mod common;

use std::path::Path;
use std::process::Command;

use bounce::Dma;
use common::*;
use devices::block::{BlockConfig, Disk, DiskImage, MemDisk, Qcow2Disk, RawDisk};
use devices::testing::dma_matrix;
use devices::testing::durable::run;
use devices::virtio::spec::{
    feature, VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_CONFIG_WCE, VIRTIO_BLK_F_DISCARD,
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_MQ, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX,
    VIRTIO_BLK_F_SIZE_MAX, VIRTIO_BLK_F_WRITE_ZEROES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK,
    VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_VERSION_1,
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use devices::virtio::VirtioDevice;
use vm_memory::GuestMemoryMmap;

const DISK: u64 = 4 << 20;

fn raw_file(dir: &Path, name: &str, bytes: u64, seed: u64) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, pattern(seed, bytes as usize)).unwrap();
    p
}

fn dmas() -> Vec<(String, Dma)> {
    let v = dma_matrix(4096);
    let names: Vec<&str> = v.iter().map(|(n, _)| n.as_str()).collect();
    // off + first-fit x 2 modes + every allocator x 2 modes: none may drop out
    assert_eq!(
        v.len(),
        3 + 2 * bounce::AllocatorKind::ALL.len(),
        "bounce configurations: {names:?}"
    );
    println!("bounce configurations: {}", names.join(", "));
    v
}

fn file_bytes(p: &Path, off: u64, len: usize) -> Vec<u8> {
    let all = std::fs::read(p).unwrap();
    all[off as usize..off as usize + len].to_vec()
}

/// A device on a fresh memory disk of `DISK` bytes (see [`Blk::new`]).
fn mem_blk(cfg: BlockConfig, dma: Dma, drop: u64) -> Blk<MemDisk> {
    Blk::new(MemDisk::new(DISK).unwrap(), cfg, dma, drop)
}

/// Writes and reads back through every layout, checking the file and the guest buffers.
fn exercise_rw<D: Disk>(blk: &mut Blk<D>, check: &dyn Fn(u64, &[u8]), tag: &str) {
    let layouts = [
        Layout::Simple,
        Layout::Split(3),
        Layout::Split(8),
        Layout::Indirect,
        Layout::Merged,
    ];
    for (i, &layout) in layouts.iter().enumerate() {
        let sector = 8 + 40 * i as u64;
        let len = 512 * (1 + 7 * i as u32);
        let data = pattern(1000 + i as u64, len as usize);
        let w = blk.write(sector, &data, layout);
        assert_eq!(w.status, VIRTIO_BLK_S_OK, "{tag} {layout:?} write");
        assert_eq!(
            w.len, 1,
            "{tag} {layout:?}: used len of a write is the status byte"
        );
        check(sector * 512, &data);
        let r = blk.read(sector, len, layout);
        assert_eq!(r.status, VIRTIO_BLK_S_OK, "{tag} {layout:?} read");
        assert_eq!(r.len, len + 1, "{tag} {layout:?}: used len of a read");
        assert!(r.data == data, "{tag} {layout:?}: read-back differs");
    }
    // A large request crossing many bounce slots and pages (256 KiB in 4 descriptors).
    let data = pattern(77, 256 << 10);
    ok(&blk.write(2048, &data, Layout::Split(4)));
    check(2048 * 512, &data);
    let r = blk.read(2048, data.len() as u32, Layout::Split(4));
    ok(&r);
    assert!(r.data == data, "{tag}: large read-back differs");
    // The last sector of the disk is reachable.
    let last = blk.drv.device.capacity() - 1;
    let d = pattern(5, 512);
    ok(&blk.write(last, &d, Layout::Simple));
    check(last * 512, &d);
    assert_eq!(blk.read(last, 512, Layout::Simple).data, d);
}

#[test]
fn raw_read_write_all_dma_policies() {
    let dir = tempfile::tempdir().unwrap();
    for (name, dma) in dmas() {
        let path = raw_file(dir.path(), "disk.raw", DISK, 1);
        let disk = RawDisk::open(&path, false).unwrap();
        let mut blk = Blk::new(disk, BlockConfig::default(), dma.clone(), 0);
        // Reads of untouched data match the file as created.
        let r = blk.read(100, 4096, Layout::Split(2));
        ok(&r);
        assert_eq!(r.data, file_bytes(&path, 100 * 512, 4096), "{name}");
        let check = |off: u64, data: &[u8]| {
            assert!(
                file_bytes(&path, off, data.len()) == data,
                "{name}: file differs at {off}"
            );
        };
        exercise_rw(&mut blk, &check, &name);
        assert_eq!(blk.metric("err_bounce"), 0, "{name}");
        if let Some(s) = dma.stats() {
            assert!(s.maps > 0, "{name}: nothing was bounced");
            assert_eq!(s.used, 0, "{name}: bounce slots leaked");
            assert_eq!(s.maps, s.unmaps, "{name}");
        }
    }
}

#[test]
fn memory_disk_read_write_all_dma_policies() {
    for (name, dma) in dmas() {
        let mut blk = mem_blk(BlockConfig::default(), dma, 0);
        let disk = std::sync::Arc::clone(blk.drv.device.disk());
        let check = move |off: u64, data: &[u8]| {
            let mut v = vec![0u8; data.len()];
            disk.read_bytes(off, &mut v).unwrap();
            assert!(v == data, "{name}: disk differs at {off}");
        };
        exercise_rw(&mut blk, &check, "memory");
    }
}

/// `qemu-img check` passes on `path` and its guest-visible contents equal `model`.
fn check_qcow2(qi: &str, path: &Path, model: &[u8], what: &str) {
    run(Command::new(qi).args(["check", "-q", "-U"]).arg(path));
    let raw = path.with_extension("converted.raw");
    run(Command::new(qi)
        .args(["convert", "-U", "-O", "raw"])
        .arg(path)
        .arg(&raw));
    assert!(
        std::fs::read(&raw).unwrap() == model,
        "{what}: qemu-img convert differs from what the guest wrote"
    );
    std::fs::remove_file(&raw).unwrap();
}

#[test]
fn qcow2_read_write_flush_discard_all_dma_policies() {
    let Some(qi) = qemu_img() else { return };
    let dir = tempfile::tempdir().unwrap();
    for (name, dma) in dmas() {
        let path = dir.path().join("disk.qcow2");
        let _ = std::fs::remove_file(&path);
        run(Command::new(qi)
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&path)
            .arg(DISK.to_string()));
        // The model of what the disk must hold.
        let model = std::cell::RefCell::new(vec![0u8; DISK as usize]);
        {
            let disk = Qcow2Disk::open(&path, false).unwrap();
            assert_eq!(disk.capacity(), DISK);
            let mut blk = Blk::new(disk, BlockConfig::default(), dma.clone(), 0);
            // A fresh image reads as zeros.
            let r = blk.read(0, 8192, Layout::Simple);
            ok(&r);
            assert!(r.data.iter().all(|&b| b == 0));
            let check = |off: u64, data: &[u8]| {
                model.borrow_mut()[off as usize..off as usize + data.len()].copy_from_slice(data);
            };
            exercise_rw(&mut blk, &check, &name);
            // Write zeroes (with and without unmap) and discard.
            let seg = discard_seg(8, 8, 0);
            let d = blk.request(0, VIRTIO_BLK_T_WRITE_ZEROES, 0, &seg, 0, Layout::Simple);
            ok(&d);
            model.borrow_mut()[8 * 512..16 * 512].fill(0);
            let seg = discard_seg(48, 1, 1);
            ok(&blk.request(0, VIRTIO_BLK_T_WRITE_ZEROES, 0, &seg, 0, Layout::Simple));
            model.borrow_mut()[48 * 512..49 * 512].fill(0);
            let r = blk.read(0, 64 * 512, Layout::Simple);
            assert!(r.data == model.borrow()[..64 * 512], "{name}: zeroes");
            // Discard contents are unspecified: rewrite afterwards to keep the model exact.
            let seg = discard_seg(2048, 128, 0);
            ok(&blk.request(0, VIRTIO_BLK_T_DISCARD, 0, &seg, 0, Layout::Simple));
            let fill = pattern(9, 128 * 512);
            ok(&blk.write(2048, &fill, Layout::Simple));
            check(2048 * 512, &fill);
            assert_eq!(blk.flush(), VIRTIO_BLK_S_OK);
            assert_eq!(blk.metric("reqs_flush"), 1);
            // What the FLUSH completed must be in the file while the device is still open
            // (dropping it would flush again and hide a FLUSH that wrote nothing): metadata
            // consistent and the data the model expects, read by qemu-img (-U: no lock).
            check_qcow2(qi, &path, &model.borrow(), &format!("{name}, device open"));
        }
        check_qcow2(
            qi,
            &path,
            &model.borrow(),
            &format!("{name}, device dropped"),
        );
    }
}

#[test]
fn disk_image_opens_both_formats() {
    let dir = tempfile::tempdir().unwrap();
    let p = raw_file(dir.path(), "a.raw", 1 << 20, 3);
    let d = DiskImage::open(&p, "raw".parse().unwrap(), true).unwrap();
    assert_eq!((d.kind(), d.capacity()), ("raw", 1 << 20));
    if let Some(qi) = qemu_img() {
        let q = dir.path().join("b.qcow2");
        run(Command::new(qi)
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&q)
            .arg("2M"));
        let d = DiskImage::open(&q, "qcow2".parse().unwrap(), false).unwrap();
        assert_eq!((d.kind(), d.capacity()), ("qcow2", 2 << 20));
    }
}

#[test]
fn features_and_config_space() {
    let mem = MemDisk::new(DISK).unwrap();
    let cfg = BlockConfig {
        num_queues: 4,
        serial: "abc".into(),
        blk_size: 4096,
        ..BlockConfig::default()
    };
    let dev = devices::block::Block::new(mem, cfg, Dma::direct()).unwrap();
    let f = VirtioDevice::<GuestMemoryMmap>::avail_features(&dev);
    for bit in [
        feature(VIRTIO_F_VERSION_1),
        feature(VIRTIO_F_ACCESS_PLATFORM),
        feature(VIRTIO_RING_F_EVENT_IDX),
        feature(VIRTIO_RING_F_INDIRECT_DESC),
        feature(VIRTIO_BLK_F_SEG_MAX),
        feature(VIRTIO_BLK_F_SIZE_MAX),
        feature(VIRTIO_BLK_F_BLK_SIZE),
        feature(VIRTIO_BLK_F_FLUSH),
        feature(VIRTIO_BLK_F_MQ),
        feature(VIRTIO_BLK_F_DISCARD),
        feature(VIRTIO_BLK_F_WRITE_ZEROES),
    ] {
        assert_ne!(f & bit, 0, "feature bit {bit:#x} not offered");
    }
    assert_eq!(f & feature(VIRTIO_BLK_F_RO), 0);
    let mut c = [0u8; 64];
    VirtioDevice::<GuestMemoryMmap>::read_config(&dev, 0, &mut c);
    let u32at = |o: usize| u32::from_le_bytes(c[o..o + 4].try_into().unwrap());
    assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), DISK / 512);
    assert_eq!(u32at(8), 4 << 20, "size_max without a pool");
    assert_eq!(u32at(12), 254, "seg_max = queue size - 2");
    assert_eq!(u32at(20), 4096, "blk_size");
    assert_eq!(u16::from_le_bytes([c[34], c[35]]), 4, "num_queues");
    assert!(u32at(36) > 0 && u32at(40) > 0, "discard limits");
    assert_eq!(u32at(44), 8, "discard_sector_alignment in sectors");
    assert!(u32at(48) > 0 && u32at(52) > 0, "write zeroes limits");
    assert_eq!(c[56], 1, "write_zeroes_may_unmap");
    assert!(c[60..].iter().all(|&b| b == 0), "past the end reads zeros");
    // Reads at any offset (even absurd ones) never panic.
    let mut b = [0xffu8; 8];
    VirtioDevice::<GuestMemoryMmap>::read_config(&dev, u64::MAX - 2, &mut b);
    assert_eq!(b, [0; 8]);

    // Switches: readonly offers RO, ACCESS_PLATFORM can be turned off, one queue has no MQ.
    let cfg = BlockConfig {
        readonly: true,
        access_platform: false,
        ..BlockConfig::default()
    };
    let dev = devices::block::Block::new(MemDisk::new(DISK).unwrap(), cfg, Dma::direct()).unwrap();
    let f = VirtioDevice::<GuestMemoryMmap>::avail_features(&dev);
    assert_ne!(f & feature(VIRTIO_BLK_F_RO), 0);
    assert_eq!(f & feature(VIRTIO_F_ACCESS_PLATFORM), 0);
    assert_eq!(f & feature(VIRTIO_BLK_F_MQ), 0);

    // With a bounce pool, size_max is the pool's largest mapping.
    let dmas = dma_matrix(1024);
    let dev = devices::block::Block::new(
        MemDisk::new(DISK).unwrap(),
        BlockConfig::default(),
        dmas[1].1.clone(),
    )
    .unwrap();
    let mut c = [0u8; 12];
    VirtioDevice::<GuestMemoryMmap>::read_config(&dev, 0, &mut c);
    assert_eq!(u32::from_le_bytes(c[8..12].try_into().unwrap()), 256 << 10);
}

#[test]
fn config_writes_are_ignored_and_counted() {
    let mut blk = mem_blk(BlockConfig::default(), Dma::direct(), 0);
    let before = blk.drv.read_config(0, 60);
    VirtioDevice::<GuestMemoryMmap>::write_config(&mut blk.drv.device, 0, &[1, 2, 3, 4]);
    VirtioDevice::<GuestMemoryMmap>::write_config(&mut blk.drv.device, 32, &[1, 0]);
    assert_eq!(blk.drv.read_config(0, 60), before);
    assert_eq!(blk.metric("config_write_rejected"), 2);
    // `writeback` (offset 32, one byte) is the one writable field with CONFIG_WCE: the
    // driver sets the cache mode there, as with QEMU.
    assert_eq!(
        before[32], 1,
        "cache=writeback starts with the write cache on"
    );
    VirtioDevice::<GuestMemoryMmap>::write_config(&mut blk.drv.device, 32, &[0]);
    assert_eq!(blk.drv.read_config(32, 1), [0]);
    assert_eq!(blk.metric("config_wce_writes"), 1);
    assert_eq!(blk.metric("config_write_rejected"), 2);
}

#[test]
fn activation_rules() {
    let mut dev = devices::block::Block::new(
        MemDisk::new(DISK).unwrap(),
        BlockConfig::default(),
        Dma::direct(),
    )
    .unwrap();
    // A legacy driver (no VERSION_1) is refused.
    assert!(VirtioDevice::<GuestMemoryMmap>::activate(&mut dev, 0).is_err());
    let w = VirtioDevice::<GuestMemoryMmap>::activate(&mut dev, u64::MAX).unwrap();
    assert_eq!(w.len(), 1);
    // Bits never offered are dropped.
    assert_eq!(
        dev.acked_features().unwrap() & !VirtioDevice::<GuestMemoryMmap>::avail_features(&dev),
        0
    );
    assert!(
        VirtioDevice::<GuestMemoryMmap>::activate(&mut dev, u64::MAX).is_err(),
        "already active"
    );
    VirtioDevice::<GuestMemoryMmap>::reset(&mut dev);
    assert!(VirtioDevice::<GuestMemoryMmap>::activate(&mut dev, u64::MAX).is_ok());
}

#[test]
fn multiqueue_one_worker_per_queue() {
    for (name, dma) in dmas().into_iter().take(3) {
        let cfg = BlockConfig {
            num_queues: 4,
            ..BlockConfig::default()
        };
        let mut blk = mem_blk(cfg, dma, 0);
        assert_eq!(blk.drv.num_workers(), 4, "{name}");
        for q in 0..4u16 {
            assert_eq!(blk.drv.worker_queues(q as usize), vec![q]);
            let data = pattern(u64::from(q), 4096);
            let sector = 64 * u64::from(q);
            ok(&blk.request(q, VIRTIO_BLK_T_OUT, sector, &data, 0, Layout::Simple));
        }
        for q in 0..4u16 {
            // Read on another queue than the one that wrote.
            let r = blk.request(
                (q + 1) % 4,
                VIRTIO_BLK_T_IN,
                64 * u64::from(q),
                &[],
                4096,
                Layout::Split(2),
            );
            ok(&r);
            assert_eq!(r.data, pattern(u64::from(q), 4096), "{name}");
        }
    }
    // Without MQ acked, only queue 0 is served.
    let cfg = BlockConfig {
        num_queues: 4,
        ..BlockConfig::default()
    };
    let blk = mem_blk(cfg, Dma::direct(), feature(VIRTIO_BLK_F_MQ));
    assert_eq!(blk.drv.num_workers(), 1);
}

#[test]
fn read_past_end_is_ioerr() {
    for (name, dma) in dmas().into_iter().take(3) {
        let mut blk = mem_blk(BlockConfig::default(), dma, 0);
        let cap = DISK / 512;
        for (sector, len) in [
            (cap, 512),
            (cap - 1, 1024),
            (u64::MAX, 512),
            (u64::MAX / 512, 512),
            (cap + 1000, 4096),
        ] {
            let r = blk.read(sector, len, Layout::Simple);
            assert_eq!(r.status, VIRTIO_BLK_S_IOERR, "{name}: read {sector}+{len}");
            assert_eq!(r.len, 1);
            let w = blk.write(sector, &vec![1u8; len as usize], Layout::Simple);
            assert_eq!(w.status, VIRTIO_BLK_S_IOERR, "{name}: write {sector}+{len}");
        }
        // A length that is not a multiple of 512.
        assert_eq!(blk.read(0, 100, Layout::Simple).status, VIRTIO_BLK_S_IOERR);
        assert_eq!(
            blk.write(0, &[1u8; 700], Layout::Simple).status,
            VIRTIO_BLK_S_IOERR
        );
        assert!(blk.metric("err_out_of_range") >= 12);
        // And the device still serves.
        ok(&blk.read(0, 512, Layout::Simple));
    }
}

#[test]
fn readonly_refuses_writes() {
    let dir = tempfile::tempdir().unwrap();
    let path = raw_file(dir.path(), "ro.raw", DISK, 2);
    let cfg = BlockConfig {
        readonly: true,
        ..BlockConfig::default()
    };
    let mut blk = Blk::new(RawDisk::open(&path, true).unwrap(), cfg, Dma::direct(), 0);
    assert_ne!(blk.drv.acked() & feature(VIRTIO_BLK_F_RO), 0);
    assert_eq!(
        blk.write(0, &[1u8; 512], Layout::Simple).status,
        VIRTIO_BLK_S_IOERR
    );
    assert_eq!(discard_and_zeroes(&mut blk), [VIRTIO_BLK_S_IOERR; 2]);
    assert_eq!(blk.metric("err_readonly"), 3);
    let r = blk.read(0, 4096, Layout::Simple);
    ok(&r);
    assert_eq!(r.data, file_bytes(&path, 0, 4096));
    assert_eq!(blk.flush(), VIRTIO_BLK_S_OK);
    assert_eq!(
        std::fs::read(&path).unwrap(),
        pattern(2, DISK as usize),
        "file untouched"
    );
}

#[test]
fn unknown_and_unnegotiated_types_are_unsupp() {
    let mut blk = mem_blk(
        BlockConfig::default(),
        Dma::direct(),
        feature(VIRTIO_BLK_F_DISCARD) | feature(VIRTIO_BLK_F_WRITE_ZEROES),
    );
    for t in [2u32, 3, 5, 7, 14, 15, 16, 0x8000_0000, u32::MAX] {
        let d = blk.request(0, t, 0, &[], 0, Layout::Simple);
        assert_eq!(d.status, VIRTIO_BLK_S_UNSUPP, "type {t}");
        assert_eq!(d.len, 1);
    }
    assert_eq!(discard_and_zeroes(&mut blk), [VIRTIO_BLK_S_UNSUPP; 2]);
    assert_eq!(blk.metric("reqs_unsupported"), 9);
    assert_eq!(blk.metric("err_unsupported"), 11);
}

#[test]
fn get_id_returns_the_serial() {
    for (name, dma) in dmas().into_iter().take(3) {
        let cfg = BlockConfig {
            serial: "serial-0123456789-abcdef".into(),
            ..BlockConfig::default()
        };
        let mut blk = mem_blk(cfg, dma, 0);
        let d = blk.request(0, VIRTIO_BLK_T_GET_ID, 0, &[], 20, Layout::Simple);
        ok(&d);
        assert_eq!(&d.data, b"serial-0123456789-ab", "{name}");
        assert_eq!(d.len, 21);
        // A short serial is zero padded; a short buffer gets what fits.
        let cfg = BlockConfig {
            serial: "xy".into(),
            ..BlockConfig::default()
        };
        let mut blk = mem_blk(cfg, Dma::direct(), 0);
        let d = blk.request(0, VIRTIO_BLK_T_GET_ID, 0, &[], 20, Layout::Merged);
        ok(&d);
        assert_eq!(&d.data[..3], b"xy\0");
        let d = blk.request(0, VIRTIO_BLK_T_GET_ID, 0, &[], 1, Layout::Simple);
        ok(&d);
        assert_eq!(d.data, b"x");
        assert_eq!(d.len, 2);
    }
}

/// A FLUSH reaches the backend's flush (fdatasync for a raw file) after the writes it covers,
/// before its completion; without VIRTIO_BLK_F_FLUSH the device is writethrough: every write
/// is flushed before it completes. Checked by counting in a `ProbeDisk` around the raw file
/// while the device is open (reading the file back proves nothing: the page cache serves it).
#[test]
fn flush_reaches_the_file() {
    let dir = tempfile::tempdir().unwrap();
    // Writethrough: a driver that negotiates neither FLUSH nor CONFIG_WCE gets no write cache
    // (QEMU's rule; with CONFIG_WCE the driver would read and set `writeback` itself).
    for drop in [
        0,
        feature(VIRTIO_BLK_F_FLUSH) | feature(VIRTIO_BLK_F_CONFIG_WCE),
    ] {
        let path = raw_file(dir.path(), "f.raw", DISK, 4);
        let mut blk = Blk::new(
            probe_disk(RawDisk::open(&path, false).unwrap()),
            BlockConfig::default(),
            Dma::direct(),
            drop,
        );
        let probe = std::sync::Arc::clone(blk.drv.device.disk());
        let data = pattern(42, 8192);
        ok(&blk.write(16, &data, Layout::Simple));
        let after_write = probe.hook.state();
        assert!(after_write.writes >= 1, "drop={drop:#x}: {after_write:?}");
        if drop == 0 {
            // writeback: the write completed unflushed, the FLUSH request flushes it
            assert_eq!(
                after_write.flushes, 0,
                "writeback flushed early: {after_write:?}"
            );
            assert!(after_write.unflushed >= 1);
            assert_eq!(blk.flush(), VIRTIO_BLK_S_OK);
            let s = probe.hook.state();
            assert_eq!(s.flushes, 1, "FLUSH did not reach the disk: {s:?}");
            assert_eq!(s.unflushed, 0, "{s:?}");
        } else {
            // writethrough: flushed before the write completed
            assert_eq!(
                after_write.unflushed, 0,
                "writethrough left a write unflushed: {after_write:?}"
            );
            assert!(after_write.flushes >= 1, "{after_write:?}");
        }
        assert_eq!(file_bytes(&path, 16 * 512, 8192), data);
    }
}

/// The status of a one-payload request of type `t` on queue 0 in the simple layout.
fn simple_status<D: Disk>(blk: &mut Blk<D>, t: u32, payload: &[u8]) -> u8 {
    blk.request(0, t, 0, payload, 0, Layout::Simple).status
}

/// The statuses of a DISCARD and of a WRITE_ZEROES of sectors 0..8.
fn discard_and_zeroes<D: Disk>(blk: &mut Blk<D>) -> [u8; 2] {
    let seg = discard_seg(0, 8, 0);
    [VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_WRITE_ZEROES].map(|t| simple_status(blk, t, &seg))
}

#[test]
fn discard_and_write_zeroes_raw() {
    let dir = tempfile::tempdir().unwrap();
    for (name, dma) in dmas().into_iter().take(3) {
        let path = raw_file(dir.path(), "d.raw", DISK, 5);
        let mut blk = Blk::new(
            RawDisk::open(&path, false).unwrap(),
            BlockConfig::default(),
            dma,
            0,
        );
        // Two segments in one request.
        let mut segs = discard_seg(8, 8, 0).to_vec();
        segs.extend_from_slice(&discard_seg(100, 16, 0));
        ok(&blk.request(0, VIRTIO_BLK_T_WRITE_ZEROES, 0, &segs, 0, Layout::Split(2)));
        assert!(
            file_bytes(&path, 8 * 512, 4096).iter().all(|&b| b == 0),
            "{name}"
        );
        assert!(
            file_bytes(&path, 100 * 512, 8192).iter().all(|&b| b == 0),
            "{name}"
        );
        assert_eq!(
            file_bytes(&path, 16 * 512, 512),
            pattern(5, DISK as usize)[16 * 512..17 * 512]
        );
        // Unmap flag: punches a hole, reads back zeros.
        ok(&blk.request(
            0,
            VIRTIO_BLK_T_WRITE_ZEROES,
            0,
            &discard_seg(256, 64, 1),
            0,
            Layout::Simple,
        ));
        assert!(blk
            .read(256, 64 * 512, Layout::Simple)
            .data
            .iter()
            .all(|&b| b == 0));
        // Discard: raw files punch a hole.
        ok(&blk.request(
            0,
            VIRTIO_BLK_T_DISCARD,
            0,
            &discard_seg(512, 8, 0),
            0,
            Layout::Simple,
        ));
        assert!(file_bytes(&path, 512 * 512, 4096).iter().all(|&b| b == 0));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), DISK, "size kept");
        // The unmap flag on a discard, or reserved flags, are UNSUPP.
        assert_eq!(
            simple_status(&mut blk, VIRTIO_BLK_T_DISCARD, &discard_seg(0, 1, 1)),
            VIRTIO_BLK_S_UNSUPP
        );
        assert_eq!(
            simple_status(&mut blk, VIRTIO_BLK_T_WRITE_ZEROES, &discard_seg(0, 1, 2)),
            VIRTIO_BLK_S_UNSUPP
        );
        // Past the end, too many segments, a ragged payload: IOERR.
        let cap = DISK / 512;
        assert_eq!(
            simple_status(&mut blk, VIRTIO_BLK_T_DISCARD, &discard_seg(cap - 1, 2, 0)),
            VIRTIO_BLK_S_IOERR
        );
        assert_eq!(
            simple_status(
                &mut blk,
                VIRTIO_BLK_T_WRITE_ZEROES,
                &discard_seg(u64::MAX, 2, 0)
            ),
            VIRTIO_BLK_S_IOERR
        );
        let many: Vec<u8> = (0..17).flat_map(|i| discard_seg(i * 8, 8, 0)).collect();
        assert_eq!(
            simple_status(&mut blk, VIRTIO_BLK_T_DISCARD, &many),
            VIRTIO_BLK_S_IOERR
        );
        assert_eq!(
            simple_status(&mut blk, VIRTIO_BLK_T_DISCARD, &[0u8; 10]),
            VIRTIO_BLK_S_IOERR
        );
        assert_eq!(
            simple_status(&mut blk, VIRTIO_BLK_T_DISCARD, &[]),
            VIRTIO_BLK_S_IOERR
        );
        assert_eq!(blk.metric("reqs_discard"), 6);
    }
}

#[test]
fn event_idx_suppresses_and_re_arms() {
    let mut blk = mem_blk(BlockConfig::default(), Dma::direct(), 0);
    assert_ne!(blk.drv.acked() & feature(VIRTIO_RING_F_EVENT_IDX), 0);
    // used_event = 0: the first completion (used idx 0 -> 1) notifies.
    blk.drv.vqs[0].set_used_event(blk.drv.ram.mem(), 0).unwrap();
    let p = blk.post(0, VIRTIO_BLK_T_IN, 0, &[], 512, Layout::Simple);
    let sig = blk.drv.kick(0).unwrap();
    assert!(sig.has(0));
    blk.drv.reap(0);
    let _ = p;
    // The device re-armed: avail_event is where it will look next.
    assert_eq!(blk.drv.vqs[0].avail_event(blk.drv.ram.mem()).unwrap(), 1);
    // used_event far ahead: completions do not notify.
    blk.drv.vqs[0]
        .set_used_event(blk.drv.ram.mem(), 100)
        .unwrap();
    for _ in 0..3 {
        blk.post(0, VIRTIO_BLK_T_IN, 0, &[], 512, Layout::Simple);
    }
    let sig = blk.drv.kick(0).unwrap();
    assert!(!sig.has(0));
    assert_eq!(blk.drv.reap(0).len(), 3);
    assert_eq!(blk.drv.vqs[0].avail_event(blk.drv.ram.mem()).unwrap(), 4);
    // used_event = 5: the batch 4 -> 8 crosses it and notifies once.
    blk.drv.vqs[0].set_used_event(blk.drv.ram.mem(), 5).unwrap();
    for _ in 0..4 {
        blk.post(0, VIRTIO_BLK_T_IN, 0, &[], 512, Layout::Simple);
    }
    assert!(blk.drv.kick(0).unwrap().has(0));
    assert_eq!(blk.drv.reap(0).len(), 4);
    assert_eq!(blk.metric("queue_depth_hiwater"), 4);

    // Without EVENT_IDX: NO_INTERRUPT suppresses.
    let mut blk = mem_blk(
        BlockConfig::default(),
        Dma::direct(),
        feature(VIRTIO_RING_F_EVENT_IDX),
    );
    blk.drv.vqs[0]
        .set_no_interrupt(blk.drv.ram.mem(), true)
        .unwrap();
    blk.post(0, VIRTIO_BLK_T_IN, 0, &[], 512, Layout::Simple);
    assert!(!blk.drv.kick(0).unwrap().has(0));
    blk.drv.vqs[0]
        .set_no_interrupt(blk.drv.ram.mem(), false)
        .unwrap();
    blk.post(0, VIRTIO_BLK_T_IN, 0, &[], 512, Layout::Simple);
    assert!(blk.drv.kick(0).unwrap().has(0));
    // A kick with nothing new asks for no notification.
    assert!(!blk.drv.kick(0).unwrap().has(0));
}

#[test]
fn full_queue_is_drained_in_one_kick() {
    let mut blk = mem_blk(BlockConfig::default(), Dma::direct(), 0);
    let mut heads = Vec::new();
    // 64-entry queue, 3 descriptors per request: 21 requests fit.
    for i in 0..21u64 {
        heads.push(
            blk.post(
                0,
                VIRTIO_BLK_T_OUT,
                i * 8,
                &pattern(i, 4096),
                0,
                Layout::Simple,
            )
            .head,
        );
    }
    blk.drv.kick(0).unwrap();
    let used = blk.drv.reap(0);
    let mut ids: Vec<u32> = used.iter().map(|u| u.id).collect();
    ids.sort_unstable();
    let mut want: Vec<u32> = heads.iter().map(|&h| u32::from(h)).collect();
    want.sort_unstable();
    assert_eq!(ids, want);
    for i in 0..21u64 {
        assert_eq!(blk.read(i * 8, 4096, Layout::Simple).data, pattern(i, 4096));
    }
}

#[test]
fn stats_are_json_with_bounce_pool() {
    let dmas = dma_matrix(1024);
    let mut blk = mem_blk(BlockConfig::default(), dmas[1].1.clone(), 0);
    ok(&blk.write(0, &[7u8; 4096], Layout::Simple));
    ok(&blk.read(0, 4096, Layout::Simple));
    let s = blk.stats();
    assert_eq!(s["type"], "block");
    assert_eq!(s["disk"], "memory");
    assert_eq!(s["policy"], "force");
    assert_eq!(s["metrics"]["reqs_in"], 1);
    assert_eq!(s["metrics"]["reqs_out"], 1);
    assert_eq!(s["metrics"]["bytes_read"], 4096);
    assert_eq!(s["metrics"]["bytes_written"], 4096);
    assert!(s["bounce"]["maps"].as_u64().unwrap() >= 6, "{s}");
    assert_eq!(s["bounce"]["used"], 0);
    let s = mem_blk(BlockConfig::default(), Dma::direct(), 0).stats();
    assert!(s["bounce"].is_null());
}

/// A backend that fails one write (EIO, ENOSPC), one read or one
/// flush. The guest sees IOERR for exactly that request; every request acknowledged before and
/// after it is on the disk; a read that failed succeeds when retried; the device keeps serving;
/// a bounced run holds no slot after the error path.
#[test]
fn disk_faults_fail_only_the_affected_request() {
    for (name, dma) in dma_matrix(1024).into_iter().take(3) {
        for (op, errno) in [
            (DiskOp::Write, libc::EIO),
            (DiskOp::Write, libc::ENOSPC),
            (DiskOp::Read, libc::EIO),
            (DiskOp::Flush, libc::EIO),
        ] {
            let what = format!("{name} {op:?} errno {errno}");
            let mut blk = Blk::new(
                probe_disk(MemDisk::new(DISK).unwrap()),
                BlockConfig::default(),
                dma.clone(),
                0,
            );
            let probe = std::sync::Arc::clone(blk.drv.device.disk());
            let block = |i: u64| pattern(500 + i, 4096);
            // Six 4 KiB writes at sectors 8*i; with op == Write the fourth one fails.
            for i in 0..6u64 {
                if op == DiskOp::Write && i == 3 {
                    probe.hook.fail_nth(DiskOp::Write, 1, errno);
                }
                let w = blk.write(8 * i, &block(i), Layout::Split(2));
                let want = if op == DiskOp::Write && i == 3 {
                    VIRTIO_BLK_S_IOERR
                } else {
                    VIRTIO_BLK_S_OK
                };
                assert_eq!((w.status, w.len), (want, 1), "{what}: write {i}");
            }
            if op == DiskOp::Flush {
                probe.hook.fail_nth(DiskOp::Flush, 1, errno);
                assert_eq!(blk.flush(), VIRTIO_BLK_S_IOERR, "{what}: the failed flush");
            }
            assert_eq!(
                blk.flush(),
                VIRTIO_BLK_S_OK,
                "{what}: flush after the fault"
            );
            // Every acknowledged write reads back; the failed one left its sectors as they were.
            for i in 0..6u64 {
                if op == DiskOp::Read && i == 2 {
                    probe.hook.fail_nth(DiskOp::Read, 1, errno);
                    let r = blk.read(8 * i, 4096, Layout::Simple);
                    assert_eq!(
                        (r.status, r.len),
                        (VIRTIO_BLK_S_IOERR, 1),
                        "{what}: the failed read"
                    );
                }
                let r = blk.read(8 * i, 4096, Layout::Simple);
                ok(&r);
                if op == DiskOp::Write && i == 3 {
                    assert!(
                        r.data.iter().all(|&b| b == 0),
                        "{what}: failed write changed data"
                    );
                } else {
                    assert!(r.data == block(i), "{what}: acknowledged write {i} lost");
                }
            }
            assert_eq!(
                probe.hook.state().injected,
                1,
                "{what}: the fault was never hit"
            );
            // The device keeps serving.
            ok(&blk.write(100, &block(9), Layout::Indirect));
            assert_eq!(blk.read(100, 4096, Layout::Merged).data, block(9), "{what}");
            if let Some(s) = dma.stats() {
                assert_eq!(s.used, 0, "{what}: bounce slots leaked on the error path");
            }
        }
    }
}

/// The device DMA-mask path works end to end. A device with an alignment
/// mask (Linux `min_align_mask`) can map less in one piece; `size_max` says so, and a request
/// larger than that is mapped in pieces the pool accepts, with the data intact and no slot
/// leaked. `-bounce mask=` (Policy::Mask) is tested in bounce/src/dma.rs.
#[test]
fn device_dma_constraints_set_size_max_and_large_requests_still_work() {
    use bounce::{DeviceDmaParams, Dma, Policy, PoolConfig};
    let pool = devices::testing::first_fit_pool(&PoolConfig::swiotlb(1024));
    let plain = Dma::bounced(Policy::Force, std::sync::Arc::clone(&pool));
    let params = DeviceDmaParams {
        min_align_mask: 0xfff,
        ..DeviceDmaParams::default()
    };
    let masked = plain.clone().with_params(params);
    let (full, less) = (
        plain.max_mapping_size().unwrap(),
        masked.max_mapping_size().unwrap(),
    );
    assert!(less < full, "{less} < {full}: the mask costs padding slots");
    let mut blk = Blk::new(
        MemDisk::new(4 << 20).unwrap(),
        BlockConfig::default(),
        masked,
        0,
    );
    let size_max = u32::from_le_bytes(blk.drv.read_config(8, 4).try_into().unwrap());
    assert_eq!(size_max as usize, less);
    let data = pattern(21, 1 << 20);
    blk.drv.device.disk().write_bytes(0, &data).unwrap();
    let r = blk.read(0, 1 << 20, Layout::Simple);
    ok(&r);
    assert!(r.data == data, "data through masked pieces");
    let w = blk.write(4096, &data, Layout::Simple);
    ok(&w);
    assert!(blk.read(4096, 1 << 20, Layout::Simple).data == data);
    assert_eq!(pool.used(), 0, "slots leaked");
}
