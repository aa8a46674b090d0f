//! virtio-net through a real tap, inside a network namespace this test creates.
//!
//! The device end runs on a thread that entered the namespace (`setns`), where the test
//! creates the tap (through the device's own `Tap::open`) and an AF_PACKET socket with vnet
//! headers on it. Frames the test driver posts on TX must come out of the tap as sent (a
//! plain frame byte for byte, a CSUM-partial frame and a TSO frame with their offload
//! metadata), and frames written into the tap side (plain, CSUM-partial and a 64 KiB TSO one)
//! must reach the driver's RX buffers, the large one spread over several buffers with
//! MRG_RXBUF. Runs with the bounce module off, forced swiotlb and forced iova. The namespace is
//! deleted at the end, even on failure. Skipped, with the reason printed, when not root or
//! without /dev/net/tun or `ip`.

#![allow(clippy::undocumented_unsafe_blocks)]

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::time::{Duration, Instant};

use bounce::testing::Resource;
use bounce::Dma;
use devices::net::header::VnetHeader;
use devices::net::worker::TOKEN_BACKEND;
use devices::net::{Net, NetConfig, MAX_FRAME_LEN, VNET_HDR_LEN};
use devices::testing::{forced_dmas, tso4_header, TestDriver};
use devices::virtio::driver::Buf;
use devices::virtio::spec::{
    feature, VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_VERSION_1, VIRTIO_NET_F_CSUM, VIRTIO_NET_F_CTRL_VQ,
    VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_HOST_TSO4,
    VIRTIO_NET_F_MRG_RXBUF, VIRTIO_NET_HDR_F_NEEDS_CSUM, VIRTIO_NET_HDR_GSO_TCPV4,
    VIRTIO_RING_F_EVENT_IDX,
};

const SOL_PACKET: libc::c_int = 263;
const PACKET_VNET_HDR: libc::c_int = 15;
const TAP: &str = "bvmtap0";
const RXQ: u16 = 0;
const TXQ: u16 = 1;

/// What this test needs and this machine lacks (root, a tun device, `ip`), if anything.
fn skip_reason() -> Option<(Resource, &'static str)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some((Resource::Root, "not root"));
    }
    if !std::path::Path::new("/dev/net/tun").exists() {
        return Some((Resource::Tun, "/dev/net/tun is missing"));
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Some((Resource::Root, "the `ip` command is missing"));
    }
    None
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Deletes the namespace when dropped, whatever happened.
struct Netns(String);

impl Netns {
    /// A new namespace `bvm-{tag}-{pid}` (a stale one of that name is deleted first).
    fn create(tag: &str) -> Self {
        let name = format!("bvm-{tag}-{}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        ip(&["netns", "add", &name]);
        Self(name)
    }

    /// Moves the calling thread into the namespace.
    fn enter(&self) {
        let path = format!("/var/run/netns/{}", self.0);
        let f = std::fs::File::open(&path).expect("open netns");
        let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

/// Runs `body` on a thread that entered a new namespace ([`Netns::create`] with `tag`),
/// deletes the namespace whatever happened, and passes on the thread's panic. Reports what
/// is missing and returns at once on a machine that cannot run it ([`skip_reason`]).
fn in_netns(tag: &str, body: impl FnOnce(&Netns) + Send) {
    if let Some((resource, why)) = skip_reason() {
        bounce::testing::missing(resource, why);
        return;
    }
    let ns = Netns::create(tag);
    let r = std::thread::scope(|s| {
        s.spawn(|| {
            ns.enter();
            body(&ns);
        })
        .join()
    });
    drop(ns);
    if let Err(e) = r {
        std::panic::resume_unwind(e);
    }
}

/// An AF_PACKET socket on the tap with vnet headers (10-byte `virtio_net_hdr`).
struct PacketSock(OwnedFd);

impl PacketSock {
    fn open(ifname: &str) -> Self {
        let proto = (libc::ETH_P_ALL as u16).to_be();
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(proto)) };
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let one: libc::c_int = 1;
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                SOL_PACKET,
                PACKET_VNET_HDR,
                (&one as *const libc::c_int).cast(),
                4,
            )
        };
        assert_eq!(r, 0, "PACKET_VNET_HDR: {}", std::io::Error::last_os_error());
        let name = CString::new(ifname).unwrap();
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        assert!(ifindex > 0);
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = ifindex as i32;
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(r, 0, "bind: {}", std::io::Error::last_os_error());
        Self(fd)
    }

    /// Sends `vnet_hdr(10) + frame`.
    fn send(&self, buf: &[u8]) {
        let n = unsafe { libc::send(self.0.as_raw_fd(), buf.as_ptr().cast(), buf.len(), 0) };
        assert_eq!(
            n,
            buf.len() as isize,
            "send: {}",
            std::io::Error::last_os_error()
        );
    }

    /// Receives frames until one satisfies `want` (2 s at most).
    fn recv_matching(&self, want: impl Fn(&[u8]) -> bool) -> Vec<u8> {
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut buf = vec![0u8; 70_000];
        loop {
            let n = unsafe {
                libc::recv(
                    self.0.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n > 0 {
                let f = &buf[..n as usize];
                if want(f) {
                    return f.to_vec();
                }
                continue;
            }
            assert!(
                Instant::now() < deadline,
                "no matching frame came out of the tap"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

const GUEST_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
const OTHER_MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0x00, 0x99];

/// Ethernet + IPv4 + TCP (or UDP) headers then `payload` bytes; `marker` goes in the IP id.
fn ip_frame(dst: [u8; 6], src: [u8; 6], tcp: bool, payload: usize, marker: u16) -> Vec<u8> {
    let l4 = if tcp { 20 } else { 8 };
    let mut f = Vec::new();
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&[0x08, 0x00]);
    let tot = (20 + l4 + payload).min(65535) as u16;
    f.extend_from_slice(&[0x45, 0, (tot >> 8) as u8, tot as u8]);
    f.extend_from_slice(&marker.to_be_bytes());
    f.extend_from_slice(&[0x40, 0, 64, if tcp { 6 } else { 17 }, 0, 0]);
    f.extend_from_slice(&[10, 99, 0, 2, 10, 99, 0, 3]);
    // IPv4 header checksum.
    let mut sum = 0u32;
    for c in f[14..34].chunks(2) {
        sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    let c = !(sum as u16);
    f[24..26].copy_from_slice(&c.to_be_bytes());
    if tcp {
        f.extend_from_slice(&[0x30, 0x39, 0x13, 0x89, 0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x18]);
        f.extend_from_slice(&[0xff, 0xff, 0, 0, 0, 0]);
    } else {
        let ul = (8 + payload) as u16;
        f.extend_from_slice(&[0x30, 0x39, 0x13, 0x89]);
        f.extend_from_slice(&ul.to_be_bytes());
        f.extend_from_slice(&[0, 0]);
    }
    f.extend((0..payload).map(|i| (i as u8).wrapping_mul(7).wrapping_add(marker as u8)));
    f
}

fn ip_id(frame: &[u8]) -> Option<u16> {
    (frame.len() >= 20 && frame[12..14] == [0x08, 0x00])
        .then(|| u16::from_be_bytes([frame[18], frame[19]]))
}

/// TX phase: a plain, a CSUM-partial and a TSO frame, each split over three descriptors
/// (header and two pieces), must come out of the tap unchanged with their vnet headers kept.
/// Returns the bytes the driver sent (headers included).
fn check_tx(
    drv: &mut TestDriver<Net>,
    sock: &PacketSock,
    name: &str,
    csum_hdr: VnetHeader,
    tso_hdr: VnetHeader,
) -> usize {
    let plain = ip_frame(OTHER_MAC, GUEST_MAC, false, 1400, 0x1001);
    let csum = ip_frame(OTHER_MAC, GUEST_MAC, false, 300, 0x1002);
    let tso = ip_frame(OTHER_MAC, GUEST_MAC, true, 20_000, 0x1003);
    for (h, f) in [
        (VnetHeader::default(), &plain),
        (csum_hdr, &csum),
        (tso_hdr, &tso),
    ] {
        let hb = drv.ram.alloc_bytes(&h.to_bytes());
        let (a, b) = f.split_at(f.len() / 3);
        let fa = drv.ram.alloc_bytes(a);
        let fb = drv.ram.alloc_bytes(b);
        drv.post(
            TXQ,
            &[
                Buf::ro(hb, VNET_HDR_LEN as u32),
                Buf::ro(fa, a.len() as u32),
                Buf::ro(fb, b.len() as u32),
            ],
        )
        .unwrap();
    }
    drv.kick(TXQ).unwrap();
    assert_eq!(drv.reap(TXQ).len(), 3, "{name}");
    let got = sock.recv_matching(|f| ip_id(&f[10..]) == Some(0x1001));
    assert_eq!(&got[10..], &plain[..], "{name}: plain frame");
    let got = sock.recv_matching(|f| ip_id(&f[10..]) == Some(0x1002));
    assert_eq!(&got[10..], &csum[..], "{name}: csum frame");
    assert_eq!(
        got[0] & VIRTIO_NET_HDR_F_NEEDS_CSUM,
        VIRTIO_NET_HDR_F_NEEDS_CSUM,
        "{name}"
    );
    assert_eq!(u16::from_le_bytes([got[6], got[7]]), 34);
    let got = sock.recv_matching(|f| ip_id(&f[10..]) == Some(0x1003));
    assert_eq!(&got[10..], &tso[..], "{name}: tso frame");
    assert_eq!(got[1], VIRTIO_NET_HDR_GSO_TCPV4, "{name}: gso type kept");
    assert_eq!(
        u16::from_le_bytes([got[4], got[5]]),
        1448,
        "{name}: gso size kept"
    );
    plain.len() + csum.len() + tso.len() + 3 * VNET_HDR_LEN
}

/// RX phase: reassembles the frames the driver receives (`num_buffers` from the first buffer;
/// `bufs` maps a posted head to its buffer's address) until the three test frames are in, for
/// at most 3 s.
fn receive_frames(
    drv: &mut TestDriver<Net>,
    bufs: &std::collections::HashMap<u32, u64>,
    name: &str,
) -> Vec<(VnetHeader, Vec<u8>)> {
    let mut frames: Vec<(VnetHeader, Vec<u8>)> = Vec::new();
    let mut pending: Vec<(u32, u32)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(3);
    while frames
        .iter()
        .filter(|(_, f)| ip_id(f).is_some_and(|i| i >> 8 == 0x20))
        .count()
        < 3
    {
        assert!(
            Instant::now() < deadline,
            "{name}: frames did not reach the driver: {frames:?}"
        );
        drv.fd_event(0, TOKEN_BACKEND).unwrap();
        pending.extend(drv.reap(RXQ).iter().map(|u| (u.id, u.len)));
        while let Some(&(id, len)) = pending.first() {
            let first = drv.ram.read(bufs[&id], len as usize);
            let hdr = VnetHeader::from_bytes(first[..12].try_into().unwrap());
            let n = usize::from(hdr.num_buffers);
            if pending.len() < n {
                break;
            }
            let mut data = first[12..].to_vec();
            for &(id, len) in &pending[1..n] {
                data.extend(drv.ram.read(bufs[&id], len as usize));
            }
            pending.drain(..n);
            frames.push((hdr, data));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    frames
}

/// Through the bounce path (when `dma` bounces): every payload matched byte for byte; the pool
/// holds no slot after the traffic and copied at least what moved each way (`tx` and `rx`
/// bytes).
fn check_bounced(dma: &Dma, name: &str, tx: usize, rx: usize) {
    let Some(b) = dma.stats() else { return };
    assert_eq!(
        b.used, 0,
        "{name}: bounce slots held after the traffic: {b:?}"
    );
    assert_eq!(b.maps, b.unmaps, "{name}: {b:?}");
    assert!(
        b.bytes_to_device >= tx as u64,
        "{name}: TX {tx} bytes, bounced {b:?}"
    );
    assert!(
        b.bytes_from_device >= rx as u64,
        "{name}: RX {rx} bytes, bounced {b:?}"
    );
}

fn run(ns: &Netns, name: &str, dma: Dma) {
    let dev = Net::with_tap(NetConfig::default(), TAP, dma.clone()).expect("open tap in namespace");
    ip(&["-n", &ns.0, "link", "set", TAP, "up"]);
    ip(&["-n", &ns.0, "addr", "add", "10.99.0.1/24", "dev", TAP]);
    let sock = PacketSock::open(TAP);
    let mut drv = TestDriver::new(dev, 32 << 20);
    let want = feature(VIRTIO_F_VERSION_1)
        | feature(VIRTIO_F_ACCESS_PLATFORM)
        | feature(VIRTIO_RING_F_EVENT_IDX)
        | feature(VIRTIO_NET_F_MRG_RXBUF)
        | feature(VIRTIO_NET_F_CSUM)
        | feature(VIRTIO_NET_F_GUEST_CSUM)
        | feature(VIRTIO_NET_F_HOST_TSO4)
        | feature(VIRTIO_NET_F_GUEST_TSO4)
        | feature(VIRTIO_NET_F_CTRL_VQ);
    assert_eq!(drv.negotiate(want), want);
    drv.activate(256).unwrap();

    // ---- TX: plain, CSUM-partial, TSO.
    let csum_hdr = VnetHeader {
        flags: VIRTIO_NET_HDR_F_NEEDS_CSUM,
        csum_start: 34,
        csum_offset: 6,
        ..Default::default()
    };
    let tso_hdr = tso4_header();
    let tx = check_tx(&mut drv, &sock, name, csum_hdr, tso_hdr);

    // ---- RX: buffers of 4 KiB, then plain, CSUM-partial and 64 KiB TSO frames in the tap.
    let mut bufs = std::collections::HashMap::new();
    for _ in 0..64 {
        let a = drv.ram.alloc(4096, 64);
        let h = drv.post(RXQ, &[Buf::wo(a, 4096)]).unwrap();
        bufs.insert(u32::from(h), a);
    }
    drv.kick(RXQ).unwrap();
    let rx_plain = ip_frame(GUEST_MAC, OTHER_MAC, false, 1000, 0x2001);
    let rx_csum = ip_frame(GUEST_MAC, OTHER_MAC, false, 500, 0x2002);
    let rx_tso = ip_frame(GUEST_MAC, OTHER_MAC, true, MAX_FRAME_LEN - 54 - 200, 0x2003);
    let h10 = |h: &VnetHeader, f: &[u8]| {
        let mut v = h.to_bytes()[..10].to_vec();
        v.extend_from_slice(f);
        sock.send(&v);
    };
    h10(&VnetHeader::default(), &rx_plain);
    h10(&csum_hdr, &rx_csum);
    h10(&tso_hdr, &rx_tso);

    let frames = receive_frames(&mut drv, &bufs, name);
    let find = |id: u16| {
        frames
            .iter()
            .find(|(_, f)| ip_id(f) == Some(id))
            .unwrap_or_else(|| panic!("{name}: frame {id:#x} missing"))
    };
    let (h, f) = find(0x2001);
    assert_eq!(f, &rx_plain, "{name}: rx plain");
    assert_eq!(h.num_buffers, 1);
    let (h, f) = find(0x2002);
    assert_eq!(f, &rx_csum, "{name}: rx csum");
    assert_eq!(
        h.flags & VIRTIO_NET_HDR_F_NEEDS_CSUM,
        VIRTIO_NET_HDR_F_NEEDS_CSUM,
        "{name}: csum offload delivered"
    );
    let (h, f) = find(0x2003);
    assert_eq!(f, &rx_tso, "{name}: rx tso");
    assert_eq!(
        h.gso_type, VIRTIO_NET_HDR_GSO_TCPV4,
        "{name}: tso delivered unsegmented"
    );
    assert!(
        h.num_buffers >= 16,
        "{name}: 64 KiB over MRG_RXBUF buffers: {}",
        h.num_buffers
    );
    let stats = devices::virtio::VirtioDevice::<vm_memory::GuestMemoryMmap>::stats(&drv.device);
    assert_eq!(stats["net"]["tx_frames"], 3, "{name}: {stats}");
    let rx = rx_plain.len() + rx_csum.len() + rx_tso.len();
    check_bounced(&dma, name, tx, rx);
    println!("{name}: ok, stats {}", stats["net"]);
}

#[test]
fn net_through_tap_in_namespace() {
    in_netns("test", |ns| {
        let _ = Command::new("ip")
            .args([
                "netns",
                "exec",
                &ns.0,
                "sysctl",
                "-qw",
                "net.ipv6.conf.all.disable_ipv6=1",
            ])
            .output();
        for (name, dma) in forced_dmas(8192, 2) {
            run(ns, name, dma);
        }
    });
}

/// `Tap::open(Tap::KERNEL_NAMED, n)`: the kernel picks `tapN` (QEMU's `-netdev tap` without
/// `ifname=`), every queue attaches to that one interface, and `name()` reports it.
#[test]
fn a_kernel_named_tap_reports_its_name_and_every_queue_joins_it() {
    in_netns("tapname", |_| {
        let taps = devices::net::Tap::open(devices::net::Tap::KERNEL_NAMED, 2).unwrap();
        let n = taps[0].name().to_string();
        assert!(n.starts_with("tap") && !n.contains('%'), "{n}");
        assert_eq!(taps[1].name(), n);
        // Children forked from this thread live in its namespace: one interface, multi-queue.
        let out = Command::new("ip")
            .args(["-d", "link", "show"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(text.matches(": tap").count(), 1, "{text}");
        assert!(text.contains("multi_queue"), "{text}");
    });
}

/// The tap is deleted under a running device (`ip link del`, or its
/// namespace removed). Its fd then reports an error on poll (a transport stops polling it: no
/// busy loop on EPOLLERR), every read and write fails: the guest's frames are dropped and
/// counted, RX buffers stay the guest's, and the device keeps answering every event.
#[test]
fn a_tap_deleted_under_the_device_drops_and_counts_and_keeps_serving() {
    in_netns("tapgone", |ns| {
        let dev = Net::with_tap(NetConfig::default(), TAP, Dma::direct()).unwrap();
        ip(&["-n", &ns.0, "link", "set", TAP, "up"]);
        let mut drv = TestDriver::new(dev, 8 << 20);
        let want = feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_NET_F_MRG_RXBUF);
        assert_eq!(drv.negotiate(want), want);
        drv.activate(64).unwrap();
        let tap_fd = drv
            .worker_fds(0)
            .iter()
            .find(|(_, t)| *t == TOKEN_BACKEND)
            .map(|(fd, _)| *fd)
            .expect("the tap is a worker fd");
        let send = |drv: &mut TestDriver<Net>, marker: u16| {
            let mut f = VnetHeader::default().to_bytes().to_vec();
            f.extend(ip_frame(OTHER_MAC, GUEST_MAC, false, 200, marker));
            let a = drv.ram.alloc_bytes(&f);
            drv.post(TXQ, &[Buf::ro(a, f.len() as u32)]).unwrap();
            drv.kick(TXQ).expect("TX kick served");
            drv.reap(TXQ)
        };
        let counters = |drv: &TestDriver<Net>| {
            let s = devices::virtio::VirtioDevice::<vm_memory::GuestMemoryMmap>::stats(&drv.device);
            (
                s["net"]["tx_frames"].as_u64().unwrap(),
                s["net"]["tx_dropped_backend"].as_u64().unwrap(),
                s["net"]["rx_backend_errors"].as_u64().unwrap(),
            )
        };
        assert_eq!(send(&mut drv, 1).len(), 1);
        assert_eq!(counters(&drv), (1, 0, 0));

        ip(&["-n", &ns.0, "link", "del", TAP]);
        // The fd says it is dead (and not readable): what the vhost-user adapter unregisters on.
        let mut p = libc::pollfd {
            fd: tap_fd,
            events: libc::POLLIN,
            revents: 0,
        };
        assert_eq!(unsafe { libc::poll(&mut p, 1, 1000) }, 1, "no poll event");
        assert_ne!(p.revents & libc::POLLERR, 0, "revents {:#x}", p.revents);
        assert_eq!(p.revents & libc::POLLIN, 0, "revents {:#x}", p.revents);
        // RX: a buffer posted, a kick and a backend event: each returns (no retry loop on
        // the error), counts the error, and leaves the buffer with the guest.
        let b = drv.ram.alloc(4096, 8);
        drv.post(RXQ, &[Buf::wo(b, 4096)]).unwrap();
        drv.kick(RXQ).expect("RX kick served");
        drv.fd_event(0, TOKEN_BACKEND).expect("tap event served");
        assert!(drv.reap(RXQ).is_empty(), "no frame, no used RX buffer");
        let (_, _, rx_errors) = counters(&drv);
        assert!(rx_errors >= 2, "rx_backend_errors {rx_errors}");
        // TX: every chain completed (the guest gets its buffers back), the frame counted.
        for marker in 2..5 {
            let used = send(&mut drv, marker);
            assert_eq!(used.len(), 1, "TX chain {marker} not completed");
        }
        assert_eq!(counters(&drv).0, 1, "no frame reached a deleted tap");
        assert_eq!(counters(&drv).1, 3, "tx_dropped_backend");
        // A reset (the driver gives up on the device) and the end are clean.
        drv.reset();
    });
}
