//! QMP `x-query-vcpus` and HMP `info registers` on small guests run on this machine's
//! /dev/kvm, asked over the real QMP socket served by [`vmm::qmp::serve`] while the vCPU
//! threads run. Skipped (with a message) when /dev/kvm is absent.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm::bus::BusDevice;
use vmm::exit::ExitReason;
use vmm::qmp::{self, Monitor, QmpContext};
use vmm::vcpu::state::QUERY_TIMEOUT;
use vmm::{Machine, RunningMachine};

/// Where the spinning vCPU's loop starts, and the counter it increments.
const SPIN: u64 = 0x1000;
const COUNTER: u64 = 0x5000;
/// Where the halting vCPU starts.
const HALT: u64 = 0x2000;
/// A port no device claims (every access is an unhandled PIO exit).
const UNCLAIMED_PORT: u16 = 0x2f0;
/// The port of the device that holds its vCPU thread in the VMM.
const GATE_PORT: u16 = 0x2e0;

/// Loads `code` at `addr` and starts `vcpu` there in flat 32-bit mode (an AP made runnable).
fn load_flat32(m: &Machine, vcpu: usize, addr: u64, code: &Asm) {
    load(m, addr, code);
    flat32(m, vcpu, addr);
    if vcpu > 0 {
        m.vcpus()[vcpu].set_runnable().expect("runnable");
    }
}

/// `loop: inc dword [COUNTER]; out UNCLAIMED_PORT, al; jmp loop`; its length.
fn spin_with_exits() -> (Asm, u64) {
    let mut a = Asm::new();
    let top = a.here();
    a.raw(&[0xff, 0x05])
        .raw(&(COUNTER as u32).to_le_bytes())
        .mov_dx(UNCLAIMED_PORT)
        .out_dx_al()
        .jmp_to(top);
    let len = a.code.len() as u64;
    (a, len)
}

/// Loads a `hlt` loop (interrupts off) for vCPU 1, serves QMP for `m` as `name` and starts it:
/// the guest memory, the client and the running machine.
fn start_with_vcpu1_halted(m: Machine, name: &str) -> (GuestMemoryMmap, Client, RunningMachine) {
    let mut halt = Asm::new();
    halt.hlt_forever();
    load_flat32(&m, 1, HALT, &halt);
    let mem = m.memory().clone();
    let c = Client::serve(&m, name);
    (mem, c, m.start().unwrap())
}

/// A QMP client on a fresh socket served by [`qmp::serve`] for `m`'s vCPUs.
struct Client {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    dir: PathBuf,
}

impl Client {
    fn serve(m: &Machine, name: &str) -> Client {
        let dir = std::env::temp_dir().join(format!("bvm-vcpuq-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("qmp.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let ctx = QmpContext {
            exit: m.exit_handle().clone(),
            blocks: Vec::new(),
            devices: Vec::new(),
            name: None,
            vcpus: m.vcpu_shared(),
            power_button: None,
            pools: Arc::default(),
        };
        std::thread::spawn(move || qmp::serve(listener, None, ctx, Monitor::new()));
        let writer = UnixStream::connect(&path).unwrap();
        writer
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut c = Client {
            reader: BufReader::new(writer.try_clone().unwrap()),
            writer,
            dir,
        };
        let greeting = c.line();
        assert!(greeting.get("QMP").is_some(), "{greeting}");
        assert_eq!(c.cmd("qmp_capabilities", json!({})), json!({"return": {}}));
        c
    }

    fn line(&mut self) -> Value {
        let mut l = String::new();
        self.reader.read_line(&mut l).expect("QMP reply");
        serde_json::from_str(&l).unwrap_or_else(|e| panic!("{e}: {l:?}"))
    }

    fn cmd(&mut self, execute: &str, arguments: Value) -> Value {
        let msg = json!({"execute": execute, "arguments": arguments});
        writeln!(self.writer, "{msg}").unwrap();
        self.line()
    }

    /// `x-query-vcpus`; the reply must come within the bound (plus slack for a loaded host).
    fn vcpus(&mut self) -> Vec<Value> {
        let t = Instant::now();
        let r = self.cmd("x-query-vcpus", json!({}));
        let took = t.elapsed();
        assert!(
            took < QUERY_TIMEOUT + REPLY_SLACK,
            "x-query-vcpus took {took:?}"
        );
        r["return"]
            .as_array()
            .unwrap_or_else(|| panic!("{r}"))
            .clone()
    }

    /// `x-query-vcpus` until `done` holds for the answer: a vCPU thread that gets no CPU
    /// within the bound on a loaded host is reported unanswered, which is the bound working.
    fn vcpus_until(&mut self, what: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        for _ in 0..20 {
            let q = self.vcpus();
            if done(&q) {
                return q;
            }
            eprintln!("not yet {what}; asking again: {q:?}");
        }
        panic!("never {what}");
    }
}

/// Whether the vCPUs `which` answered.
fn answered(q: &[Value], which: &[usize]) -> bool {
    which.iter().all(|&i| q[i]["answered"] == true)
}

/// How much later than [`QUERY_TIMEOUT`] a reply may come on a host whose cores other work
/// keeps busy.
const REPLY_SLACK: Duration = Duration::from_secs(5);

impl Drop for Client {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn counter(m: &vm_memory::GuestMemoryMmap) -> u32 {
    m.read_obj(GuestAddress(COUNTER)).unwrap()
}

/// Polls `f` every 10 ms until it holds or `limit` passes.
fn wait_for(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    f()
}

/// vCPU 0 spins incrementing a counter with a PIO exit per round, vCPU 1 halts with
/// interrupts off, vCPU 2 is an AP never started. `x-query-vcpus` over QMP sees each where it
/// is (RIP in the loop, halted, uninitialized), the exit counts grow between two queries, and
/// the spinning vCPU keeps counting after them; `info registers -a` prints the same.
#[test]
fn x_query_vcpus_reports_a_spinning_a_halted_and_an_unstarted_vcpu() {
    let Some(m) = kvm_machine(3) else {
        return;
    };
    let (spin, spin_len) = spin_with_exits();
    load_flat32(&m, 0, SPIN, &spin);
    let (mem, mut c, running) = start_with_vcpu1_halted(m, "three");
    assert!(
        wait_for(Duration::from_secs(10), || counter(&mem) > 10),
        "the spinning vCPU does not count"
    );

    let t = Instant::now();
    let q1 = c.vcpus_until("all answered, vCPU 1 halted", |q| {
        answered(q, &[0, 1, 2]) && q[1]["mp-state"] == "halted"
    });
    let took = t.elapsed();
    let after_q1 = counter(&mem);
    eprintln!(
        "x-query-vcpus took {took:?}: {}",
        serde_json::to_string_pretty(&q1).unwrap()
    );
    assert_eq!(q1.len(), 3);
    for (i, v) in q1.iter().enumerate() {
        assert_eq!(v["cpu-index"], i);
        assert_eq!(v["answered"], true, "{v}");
        assert!(v["thread-id"].as_i64().unwrap() > 0, "{v}");
        assert!(
            ["kvm-run", "vmm"].contains(&v["thread-state"].as_str().unwrap()),
            "{v}"
        );
        assert_eq!(v["lapic"]["id"], i, "{v}");
        assert!(v.get("errors").is_none(), "{v}");
        assert_eq!(v["interrupts-enabled"], false, "{v}");
    }
    // The two started vCPUs run in protected mode; the AP is still in its reset state.
    assert!(q1[..2]
        .iter()
        .all(|v| v["sregs"]["cr0"].as_u64().unwrap() & 1 == 1));
    assert_eq!(q1[2]["sregs"]["cr0"].as_u64().unwrap() & 1, 0);
    let (v0, v1, v2) = (&q1[0], &q1[1], &q1[2]);
    assert_eq!(v0["mp-state"], "runnable");
    let rip = v0["regs"]["rip"].as_u64().unwrap();
    assert!((SPIN..SPIN + spin_len).contains(&rip), "rip {rip:#x}");
    assert!(v0["exits"]["io"].as_u64().unwrap() > 0, "{v0}");
    // The thread goes on counting while the answer is put together; an unhandled access is
    // counted before its exit.
    assert!(v0["unhandled"]["pio"].as_u64().unwrap() >= v0["exits"]["io"].as_u64().unwrap());
    assert_eq!(v1["mp-state"], "halted");
    let rip = v1["regs"]["rip"].as_u64().unwrap();
    assert!((HALT..HALT + 3).contains(&rip), "rip {rip:#x}");
    assert_eq!(v1["exits"]["io"], 0);
    assert_eq!(v2["mp-state"], "uninitialized");

    assert!(
        wait_for(Duration::from_secs(10), || counter(&mem) > after_q1 + 10),
        "the spinning vCPU stopped counting after the query"
    );
    let q2 = c.vcpus_until("all answered", |q| answered(q, &[0, 1, 2]));
    let after_q2 = counter(&mem);
    let io = |q: &[Value]| q[0]["exits"]["io"].as_u64().unwrap();
    assert!(io(&q2) > io(&q1), "{} -> {}", io(&q1), io(&q2));
    let intr = |q: &[Value], i: usize| q[i]["exits"]["intr"].as_u64().unwrap();
    // Each query kicks the halted and the unstarted vCPU out of KVM_RUN at least once.
    assert!(intr(&q2, 1) > intr(&q1, 1) && intr(&q2, 2) > intr(&q1, 2));
    assert_eq!(q2[1]["mp-state"], "halted");
    assert_eq!(q2[2]["mp-state"], "uninitialized");
    assert!(
        wait_for(Duration::from_secs(10), || counter(&mem) > after_q2 + 10),
        "the spinning vCPU stopped counting after the queries"
    );

    let wants = [
        "CPU#0 ",
        "mp-state=runnable",
        "CPU#1 ",
        "mp-state=halted",
        "CPU#2 ",
        "mp-state=uninitialized",
        "RIP=0000000000001",
        "LAPIC id=2",
    ];
    // Asked again while a vCPU thread got no CPU within the bound on a loaded host.
    let text = (0..20)
        .map(|_| {
            let r = c.cmd(
                "human-monitor-command",
                json!({"command-line": "info registers -a"}),
            );
            r["return"]
                .as_str()
                .unwrap_or_else(|| panic!("{r}"))
                .to_string()
        })
        .find(|t| wants.iter().all(|w| t.contains(w)))
        .expect("info registers -a never showed every vCPU");
    eprintln!("{text}");
    let one = c.cmd(
        "human-monitor-command",
        json!({"command-line": "info registers", "cpu-index": 1}),
    );
    let one = one["return"].as_str().unwrap();
    assert!(one.starts_with("CPU#1 ") && !one.contains("CPU#0"), "{one}");

    let exit = running.stop().unwrap();
    assert_eq!(exit.reason, ExitReason::Stopped);
    assert!(exit.vcpu_stats[0].pio_exits >= io(&q2));
}

/// A port device whose write holds the vCPU thread until the test opens the gate.
#[derive(Default)]
struct Gate {
    state: Mutex<(bool, bool)>,
    cv: Condvar,
}

impl Gate {
    fn wait_entered(&self) -> bool {
        let g = self.state.lock().unwrap();
        let (g, _) = self
            .cv
            .wait_timeout_while(g, Duration::from_secs(10), |s| !s.0)
            .unwrap();
        g.0
    }
    fn open(&self) {
        self.state.lock().unwrap().1 = true;
        self.cv.notify_all();
    }
}

struct GateDevice(Arc<Gate>);

impl BusDevice for GateDevice {
    fn read(&mut self, _base: u64, _offset: u64, _data: &mut [u8]) {}
    fn write(&mut self, _base: u64, _offset: u64, _data: &[u8]) {
        let gate = &self.0;
        let mut g = gate.state.lock().unwrap();
        g.0 = true;
        gate.cv.notify_all();
        let _ = gate
            .cv
            .wait_timeout_while(g, Duration::from_secs(30), |s| !s.1)
            .unwrap();
    }
}

/// A vCPU thread held in a VMM-side exit handler does not answer: `x-query-vcpus` reports it
/// `answered: false` with its thread state and counters after the 500 ms bound, the other
/// vCPU still answers, and once the handler returns the vCPU answers again and goes on.
#[test]
fn a_vcpu_held_in_an_exit_handler_is_reported_unanswered_within_the_bound() {
    let Some(m) = kvm_machine(2) else {
        return;
    };
    let gate = Arc::new(Gate::default());
    m.pio_bus()
        .insert(
            Arc::new(Mutex::new(GateDevice(gate.clone()))),
            GATE_PORT.into(),
            1,
        )
        .unwrap();
    // vCPU 0: one write to the gate, then the counting loop.
    let (spin, _) = spin_with_exits();
    let mut a = Asm::new();
    a.mov_dx(GATE_PORT).out_dx_al();
    let spin_at = SPIN + a.code.len() as u64;
    a.raw(&spin.code);
    load_flat32(&m, 0, SPIN, &a);
    let (mem, mut c, running) = start_with_vcpu1_halted(m, "held");
    assert!(gate.wait_entered(), "vCPU 0 never reached the gate");

    let t = Instant::now();
    let q = c.vcpus();
    let took = t.elapsed();
    eprintln!("query with a held vCPU took {took:?}: {}", q[0]);
    assert!(took >= QUERY_TIMEOUT, "{took:?}");
    assert_eq!(q[0]["answered"], false);
    assert_eq!(q[0]["thread-state"], "vmm");
    // An exit is counted once its handler returns.
    assert_eq!(q[0]["exits"]["io"], 0);
    assert!(q[0].get("regs").is_none() && q[0].get("mp-state").is_none());
    let q = c.vcpus_until("vCPU 1 answered halted", |q| {
        answered(q, &[1]) && q[1]["mp-state"] == "halted"
    });
    assert_eq!(q[0]["answered"], false);
    let text = c.cmd(
        "human-monitor-command",
        json!({"command-line": "info registers"}),
    );
    assert!(
        text["return"].as_str().unwrap().contains("did not answer"),
        "{text}"
    );

    gate.open();
    assert!(
        wait_for(Duration::from_secs(10), || counter(&mem) > 10),
        "vCPU 0 did not go on after the gate"
    );
    let q = c.vcpus_until("vCPU 0 answered", |q| answered(q, &[0]));
    let rip = q[0]["regs"]["rip"].as_u64().unwrap();
    assert!(rip >= spin_at, "rip {rip:#x}");
    let exit = running.stop().unwrap();
    assert_eq!(exit.reason, ExitReason::Stopped);
}

/// Hostile `human-monitor-command` input gets a QMP error and the session goes on.
#[test]
fn human_monitor_command_refuses_what_it_does_not_know() {
    let Some(m) = kvm_machine(1) else {
        return;
    };
    let mut c = Client::serve(&m, "hmp");
    for args in [
        json!({}),
        json!({"command-line": 7}),
        json!({"command-line": "info lapic"}),
        json!({"command-line": "x".repeat(5000)}),
        json!({"command-line": "info registers", "cpu-index": 1}),
        json!({"command-line": "info registers", "cpu-index": -1}),
        json!({"command-line": "info registers", "cpu-index": "0"}),
        json!({"command-line": "info registers", "verbose": true}),
    ] {
        let r = c.cmd("human-monitor-command", args.clone());
        assert_eq!(r["error"]["class"], "GenericError", "{args} -> {r}");
        assert!(r["error"]["desc"].as_str().unwrap().len() < 300, "{r}");
    }
    // The vCPU thread has not started: its registers are not available, the rest is.
    let r = c.cmd(
        "human-monitor-command",
        json!({"command-line": " info  registers "}),
    );
    let text = r["return"].as_str().unwrap_or_else(|| panic!("{r}"));
    assert!(
        text.starts_with("CPU#0 thread-id=0 thread-state=not-started"),
        "{text}"
    );
    assert!(text.contains("did not answer"), "{text}");
    let q = c.vcpus();
    assert_eq!(q[0]["answered"], false);
    let cmds = c.cmd("query-commands", json!({}));
    for name in ["x-query-vcpus", "human-monitor-command"] {
        assert!(
            cmds["return"]
                .as_array()
                .unwrap()
                .contains(&json!({"name": name})),
            "{cmds}"
        );
    }
}
