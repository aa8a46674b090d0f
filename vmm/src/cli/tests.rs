//! The command line's tests: whole command lines in, a `Config` or a one-line error out.

use devices::block::io::{AioMode, CacheMode, ImageFormat};
use devices::options::parse_mac;

use super::props::split_props;
use super::*;

fn p(s: &[&str]) -> Result<Config> {
    parse(s.iter().map(|s| s.to_string()))
}

fn e(a: &[&str]) -> String {
    p(a).unwrap_err().to_string()
}

#[test]
fn full_command_line_parses() {
    let c = p(&[
        "-m",
        "1G",
        "-smp",
        "2",
        "-kernel",
        "k",
        "-initrd",
        "i",
        "-append",
        "console=ttyS0",
        "-drive",
        "file=a.img,format=raw,if=virtio",
        "-drive",
        "file=b.qcow2,format=qcow2,if=none,id=d1,readonly=on",
        "-device",
        "virtio-blk-pci,drive=d1,num-queues=2,serial=abc,iommu_platform=off",
        "-netdev",
        "tap,id=n0,ifname=tap0,queues=2,script=no,downscript=no",
        "-device",
        "virtio-net-pci,netdev=n0,mac=52:54:00:00:00:01,mq=on",
        "-nographic",
        "-serial",
        "stdio",
        "-no-reboot",
        "-qmp",
        "unix:/tmp/q.sock,server,nowait",
        "-bounce",
        "policy=force,alloc=areas",
        "-bounce",
        "id=n0,policy=off",
        "-accel",
        "kvm",
    ])
    .unwrap();
    assert_eq!(c.mem_size, 1 << 30);
    assert_eq!(c.smp, 2);
    assert_eq!(c.devices.len(), 3);
    assert_eq!(c.devices[0].id(), "drive0");
    let DeviceSpec::Blk(b) = &c.devices[1] else {
        panic!()
    };
    assert_eq!((b.num_queues, b.common.iommu_platform), (2, false));
    assert_eq!((b.queue_size, b.logical_block_size), (256, 512));
    let DeviceSpec::Net(n) = &c.devices[2] else {
        panic!()
    };
    assert!(n.mq);
    assert_eq!(n.mac, Some([0x52, 0x54, 0, 0, 0, 1]));
    assert!(c.drives[1].readonly && c.drives[1].if_none);
    assert_eq!(c.drives[0].format, Some(ImageFormat::Raw));
    assert_eq!(c.netdevs[0].queues, 2);
    assert_eq!(c.qmp.as_ref().map(|q| q.wait), Some(false));
    assert_eq!(c.bounce_for("drive0").policy, bounce::Policy::Force);
    assert_eq!(c.bounce_for("n0").policy, bounce::Policy::Off);
    assert!(c.no_reboot);
    assert!(!c.no_acpi);
}

#[test]
fn usual_qemu_lines_are_accepted() {
    let c = p(&[
        "-kernel",
        "k",
        "-cpu",
        "host",
        "-machine",
        "q35,accel=kvm",
        "-M",
        "q35",
        "-accel",
        "kvm,kernel-irqchip=on",
        "-display",
        "none",
        "-vga",
        "none",
        "-nodefaults",
        "-monitor",
        "none",
        "-name",
        "guest1",
        "-enable-kvm",
        "-smp",
        "4,sockets=1,cores=4,threads=1",
        "-m",
        "1.5G",
        "-drive",
        "file=a.img,if=none,id=d0",
        "-device",
        "virtio-blk-pci,drive=d0,disable-legacy=on,disable-modern=off",
        "-nic",
        "tap,model=virtio-net-pci,mac=52-54-00-00-00-09",
        "-nic",
        "tap,ifname=t1,script=no,downscript=no",
    ])
    .unwrap();
    assert_eq!(c.smp, 4);
    assert_eq!(c.mem_size, 3 << 29);
    assert_eq!(c.name.as_deref(), Some("guest1"));
    assert_eq!(c.drives[0].format, None, "no format= means probe");
    let macs: Vec<_> = c
        .devices
        .iter()
        .filter_map(|d| match d {
            DeviceSpec::Net(n) => n.mac,
            _ => None,
        })
        .collect();
    assert_eq!(macs, vec![[0x52, 0x54, 0, 0, 0, 9], DEFAULT_MAC]);
    assert_eq!(c.netdevs[0].ifname, None);
    assert_eq!(c.netdevs[1].ifname.as_deref(), Some("t1"));
    assert_eq!(p(&["-kernel", "k", "-smp", "cpus=3"]).unwrap().smp, 3);
    assert_eq!(p(&["-kernel", "k", "-smp", "cores=5"]).unwrap().smp, 5);
    assert_eq!(p(&["-kernel", "k", "-smp", "254"]).unwrap().smp, 254);
    assert_eq!(
        p(&["-kernel", "k", "--no-acpi"]).map(|c| c.no_acpi),
        Ok(true)
    );
}

#[test]
fn help_and_version() {
    let a = |s: &str| parse_action([s.to_string()]).unwrap();
    assert_eq!(a("-h"), Action::Help);
    assert_eq!(a("--help"), Action::Help);
    assert_eq!(a("-help"), Action::Help);
    assert_eq!(a("-version"), Action::Version);
    assert_eq!(a("--version"), Action::Version);
}

#[test]
fn every_nic_and_disk_gets_its_own_default() {
    let c = p(&[
        "-kernel",
        "k",
        "-netdev",
        "tap,id=a,ifname=ta",
        "-netdev",
        "tap,id=b,ifname=tb",
        "-device",
        "virtio-net-pci,netdev=a",
        "-device",
        "virtio-net-pci,netdev=b",
        "-drive",
        "file=x",
        "-drive",
        "file=y,id=disk1",
    ])
    .unwrap();
    let mut macs = Vec::new();
    let mut serials = Vec::new();
    for d in &c.devices {
        match d {
            DeviceSpec::Net(n) => macs.push(n.mac.unwrap()),
            DeviceSpec::Blk(b) => serials.push(b.serial.clone()),
        }
    }
    assert_eq!(macs[0], DEFAULT_MAC);
    assert_eq!(macs[1][5], 0x57);
    assert_eq!(serials, vec!["drive0", "disk1"]);
    assert!(e(&[
        "-kernel",
        "k",
        "-netdev",
        "tap,id=a",
        "-device",
        "virtio-net-pci,netdev=a",
        "-device",
        "virtio-net-pci,netdev=a,id=second"
    ])
    .contains("netdev 'a' is used by more than one device"));
}

#[test]
fn drive_aio_and_cache_use_qemus_names() {
    let c = p(&["-kernel", "k", "-drive", "file=a,aio=threads,cache=none"]).unwrap();
    assert_eq!(c.drives[0].aio, Some(AioMode::Threads));
    assert_eq!(c.drives[0].cache, CacheMode::None);
    let c = p(&["-kernel", "k", "-drive", "file=a"]).unwrap();
    assert_eq!(
        (c.drives[0].aio, c.drives[0].cache),
        (None, CacheMode::Writeback)
    );
}

#[test]
fn errors_name_the_flag_or_property() {
    // The whole message.
    for (args, want) in [
        (&["-foo"][..], "unsupported option -foo"),
        (
            &["-kernel", "k", "-cpu", "host,+x2apic"],
            "unsupported property '+x2apic' of -cpu host",
        ),
        (
            &["-kernel", "k", "-drive", "file=a,snapshot=on"],
            "unsupported property 'snapshot' of -drive",
        ),
        (
            &[
                "-kernel",
                "k",
                "-drive",
                "file=a,if=none,id=d",
                "-device",
                "virtio-blk-pci,drive=d,x=1",
            ],
            "unsupported property 'x' of -device virtio-blk-pci",
        ),
        (&["-m"], "option -m requires an argument"),
        (&["-m", "1G"], "no kernel given (-kernel is required)"),
    ] {
        assert_eq!(e(args), want, "{args:?}");
    }
    // A message naming the flag or property.
    for (args, needle) in [
        (&["-kernel", "k", "-machine", "pc"][..], "type of -machine"),
        (
            &["-kernel", "k", "-machine", "q35,smm=on"],
            "smm of -machine",
        ),
        (&["-kernel", "k", "-M", "q35,usb=on"], "'usb' of -M"),
        (&["-kernel", "k", "-cpu", "qemu64"], "-cpu"),
        (&["-kernel", "k", "-display", "gtk"], "-display"),
        (&["-kernel", "k", "-smp", "255"], "1..=254"),
        (
            &["-kernel", "k", "-smp", "4,sockets=2,cores=2"],
            "sockets of -smp",
        ),
        (&["-kernel", "k", "-smp", "4,threads=2"], "threads of -smp"),
        (&["-kernel", "k", "-smp", "4,maxcpus=8"], "hotplug"),
        (&["-kernel", "k", "-m", "1.3333M"], "-m"),
        (&["-kernel", "k", "-m", "1G,maxmem=2G"], "'maxmem' of -m"),
        (
            &["-kernel", "k", "-drive", "file=a,cache=off"],
            "directsync",
        ),
        (&["-kernel", "k", "-drive", "file=a,aio=native"], "io_uring"),
        (
            &[
                "-kernel",
                "k",
                "-drive",
                "file=a,if=none,id=d",
                "-device",
                "virtio-blk-pci,drive=d,disable-legacy=off",
            ],
            "disable-legacy",
        ),
        (&["-kernel", "k", "-device", "e1000"], "'e1000'"),
        (
            &["-kernel", "k", "-device", "virtio-blk-pci,drive=nope"],
            "'nope'",
        ),
        (&["-m", "lots"], "-m"),
        (&["-kernel", "k", "-qmp", "tcp:1:2,server"], "-qmp"),
        (&["-kernel", "k", "-bounce", "policy=sometimes"], "-bounce"),
        (&["-kernel", "k", "-netdev", "user,id=n"], "only tap"),
        (&["-kernel", "k", "-nic", "user"], "only tap"),
        (
            &["-kernel", "k", "-nic", "tap,model=e1000"],
            "model of -nic tap",
        ),
        (&["-kernel", "k", "-accel", "tcg"], "-accel"),
        (
            &["-kernel", "k", "-accel", "kvm,dirty-ring-size=4096"],
            "'dirty-ring-size' of -accel kvm",
        ),
        (
            &["-kernel", "k", "-drive", "file=a,readonly=on,readonly=off"],
            "given twice",
        ),
        (
            &["-kernel", "k", "-drive", "format=raw"],
            "-drive requires file=",
        ),
    ] {
        let got = e(args);
        assert!(
            got.contains(needle),
            "{args:?}: {got:?} should name {needle:?}"
        );
    }
}

#[test]
fn sizes_macs_and_escaped_commas() {
    assert_eq!(parse_size("512"), Some(512 << 20));
    assert_eq!(parse_size("2G"), Some(2 << 30));
    assert_eq!(parse_size("1.5G"), Some(3 << 29));
    assert_eq!(parse_size("0.5M"), Some(1 << 19));
    assert_eq!(parse_size("4096B"), Some(4096));
    assert_eq!(parse_size("x"), None);
    assert_eq!(parse_size(".5G"), None);
    assert_eq!(parse_size("99999999999T"), None);
    assert_eq!(
        parse_mac("52:54:00:ab:cd:ef"),
        Ok([0x52, 0x54, 0, 0xab, 0xcd, 0xef])
    );
    assert_eq!(
        parse_mac("52-54-00-ab-cd-ef"),
        Ok([0x52, 0x54, 0, 0xab, 0xcd, 0xef])
    );
    assert!(parse_mac("52:54:00:ab:cd").is_err());
    assert!(parse_mac("52:54:00:ab:cd:e").is_err());
    assert!(parse_mac("52:54-00:ab:cd:ef").is_err());
    assert_eq!(
        devices::options::format_mac(&DEFAULT_MAC),
        "52:54:00:12:34:56"
    );
    assert_eq!(
        split_props("file=a,,b,format=raw"),
        vec!["file=a,b", "format=raw"]
    );
}
