//! Property test of the QMP monitor with hostile input, in process: the
//! real [`vmm::qmp::serve`] on a unix socket, with a block device behind `query-blockstats`
//! and `x-query-bounce` / `x-reset-bounce`.
//!
//! `hostile_qmp_sessions_always_get_qmp_shaped_replies`: per case, one client session (with
//! or without `qmp_capabilities` first) sends a sequence of
//! - commands with random names (every real one, unknown ones, non-strings), arguments of
//!   every type (objects with unknown keys, arrays, numbers, strings, null), extra envelope
//!   members and ids of any type, checked against a model of QMP's dispatcher (the error
//!   class, or a `return`; the id echoed);
//! - random JSON values, random bytes and bit-flipped commands (unbalanced brackets and open
//!   strings closed, so the framing resynchronises);
//! - nesting from 1 to 200 levels and strings up to 200 KiB (over 64 levels or 64 KiB: one
//!   `GenericError`, the session continues);
//! - commands cut into pieces sent with pauses, and several commands on one line.
//!
//! Oracle: after every input a `query-status` with a fresh id is sent and its reply must
//! arrive within 5 s; every line before it is a QMP object (`return`, `error` with string
//! `class` and `desc`, or `event`); inputs whose framing is known get exactly the expected
//! number of replies; the next session gets a greeting.
//!
//! `BVM_FUZZ_CASES` (default 256) and `BVM_FUZZ_SEED` as for the device fuzzers
//! ([`bounce::testing::fuzz_config`]); a longer run:
//! `BVM_FUZZ_CASES=10000 BVM_FUZZ_SEED=random cargo test --release -p vmm --test qmp_fuzz`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use vmm::vcpu::VcpuShared;

use proptest::prelude::*;
use serde_json::{json, Map, Value};
use vmm::qmp::{self, BlockInfo, DeviceInfo, Monitor, QmpContext, MAX_COMMAND_BYTES, MAX_NESTING};

/// The socket of the one server every case talks to.
fn server() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("bouncevm-qmp-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("qmp.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let disk = devices::block::MemDisk::new(1 << 20).unwrap();
        let blk = devices::block::Block::new(
            disk,
            devices::block::BlockConfig::default(),
            bounce::Dma::direct(),
        )
        .unwrap();
        let dev: vmm::virtio_pci::SharedVirtioDevice = Arc::new(Mutex::new(blk));
        let ctx = QmpContext {
            exit: vmm::ExitHandle::new().unwrap(),
            blocks: vec![BlockInfo {
                id: "drive0".into(),
                qdev: "virtio-blk0".into(),
                file: "/dev/null".into(),
                format: "raw".into(),
                readonly: false,
                device: Some(dev.clone()),
            }],
            devices: vec![DeviceInfo {
                id: "virtio-blk0".into(),
                driver: "virtio-blk-pci".into(),
                device: dev,
                pool: None,
            }],
            name: Some("fuzz".into()),
            vcpus: Arc::from(vec![VcpuShared::new(0), VcpuShared::new(1)]),
            power_button: None,
            pools: Arc::default(),
        };
        std::thread::spawn(move || qmp::serve(listener, None, ctx, Monitor::new()));
        path
    })
}

/// Random JSON values (small: the big ones are built on purpose).
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        "[a-z\\-_]{0,12}".prop_map(Value::String),
        any::<String>().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-z\\-]{0,10}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A command envelope with random parts.
#[derive(Clone, Debug)]
struct Cmd {
    /// `execute`: a real command, an unknown name, or a non-string.
    execute: Option<Value>,
    arguments: Option<Value>,
    id: Option<Value>,
    /// An extra envelope member.
    extra: Option<(String, Value)>,
}

fn cmd() -> impl Strategy<Value = Cmd> {
    let names = prop_oneof![
        6 => prop::sample::select(qmp::COMMANDS).prop_map(|c| Value::String(c.to_string())),
        1 => "[a-z\\-_]{0,20}".prop_map(Value::String),
        1 => json_value(),
    ];
    let args = prop_oneof![
        3 => Just(None),
        2 => Just(Some(json!({}))),
        1 => Just(Some(json!({"enable": []}))),
        1 => json_value().prop_map(|v| Some(json!({"enable": v}))),
        1 => Just(Some(json!({"query-nodes": true}))),
        1 => Just(Some(json!({"command-line": "info registers -a"}))),
        1 => (json_value(), json_value()).prop_map(|(l, c)| Some(json!({"command-line": l, "cpu-index": c}))),
        1 => json_value().prop_map(Some),
    ];
    (
        prop::option::weighted(0.95, names),
        args,
        prop::option::of(json_value()),
        prop::option::weighted(
            0.05,
            (
                "[a-z\\-]{1,8}".prop_filter("not an envelope member", |k| {
                    !matches!(k.as_str(), "execute" | "arguments" | "id")
                }),
                json_value(),
            ),
        ),
    )
        .prop_map(|(execute, arguments, id, extra)| Cmd {
            execute,
            arguments,
            id,
            extra,
        })
}

impl Cmd {
    fn to_value(&self) -> Value {
        let mut m = Map::new();
        if let Some(e) = &self.execute {
            m.insert("execute".into(), e.clone());
        }
        if let Some(a) = &self.arguments {
            m.insert("arguments".into(), a.clone());
        }
        if let Some(i) = &self.id {
            m.insert("id".into(), i.clone());
        }
        if let Some((k, v)) = &self.extra {
            m.insert(k.clone(), v.clone());
        }
        Value::Object(m)
    }

    /// The model of QMP's dispatcher: `Ok(())` for a `return`, `Err(class)` for an error.
    /// Updates `negotiated`.
    fn expect(&self, negotiated: &mut bool) -> Result<(), &'static str> {
        const GENERIC: &str = "GenericError";
        const NOT_FOUND: &str = "CommandNotFound";
        if self.extra.is_some() {
            return Err(GENERIC);
        }
        let Some(Value::String(name)) = &self.execute else {
            return Err(GENERIC);
        };
        let args = match &self.arguments {
            None => Map::new(),
            Some(Value::Object(m)) => m.clone(),
            Some(_) => return Err(GENERIC),
        };
        if !*negotiated && name != "qmp_capabilities" {
            return Err(NOT_FOUND);
        }
        if !qmp::COMMANDS.contains(&name.as_str()) {
            return Err(NOT_FOUND);
        }
        let allowed: &[&str] = match name.as_str() {
            "qmp_capabilities" => &["enable"],
            "query-blockstats" => &["query-nodes"],
            "x-reset-bounce" => &["id"],
            "human-monitor-command" => &["command-line", "cpu-index"],
            _ => &[],
        };
        if args.keys().any(|k| !allowed.contains(&k.as_str())) {
            return Err(GENERIC);
        }
        if name == "x-reset-bounce" {
            match args.get("id") {
                None => {}
                Some(Value::String(id)) if id == "virtio-blk0" => {}
                Some(Value::String(_)) => return Err("DeviceNotFound"),
                Some(_) => return Err(GENERIC),
            }
        }
        if name == "human-monitor-command" {
            let words: Option<Vec<&str>> = args
                .get("command-line")
                .and_then(Value::as_str)
                .map(|l| l.split_whitespace().collect());
            let line_ok = matches!(
                words.as_deref(),
                Some(["info", "registers"] | ["info", "registers", "-a"])
            );
            let cpu_ok = args
                .get("cpu-index")
                .is_none_or(|v| v.as_u64().is_some_and(|n| n < 2));
            if !line_ok || !cpu_ok {
                return Err(GENERIC);
            }
        }
        if name == "qmp_capabilities" {
            if *negotiated {
                return Err(NOT_FOUND);
            }
            match args.get("enable") {
                None => {}
                Some(Value::Array(a)) if a.is_empty() => {}
                Some(_) => return Err(GENERIC),
            }
            *negotiated = true;
        }
        Ok(())
    }
}

/// One piece of hostile input.
#[derive(Clone, Debug)]
enum Input {
    /// A command, checked against the model.
    Cmd(Cmd),
    /// A command sent in pieces cut at these fractions (per mille), with pauses.
    Partial(Cmd, Vec<u16>),
    /// Several commands on one line.
    Line(Vec<Cmd>),
    /// Any JSON value.
    Json(Value),
    /// Random bytes.
    Bytes(Vec<u8>),
    /// A command with bytes replaced (position per mille, byte).
    Flipped(Cmd, Vec<(u16, u8)>),
    /// A command whose arguments nest `depth` levels (arrays or objects).
    Deep(u16, bool),
    /// A command with a string of `len` bytes.
    Huge(u32),
}

fn input() -> impl Strategy<Value = Input> {
    prop_oneof![
        8 => cmd().prop_map(Input::Cmd),
        2 => (cmd(), prop::collection::vec(0u16..1000, 1..5)).prop_map(|(c, p)| Input::Partial(c, p)),
        1 => prop::collection::vec(cmd(), 2..4).prop_map(Input::Line),
        2 => json_value().prop_map(Input::Json),
        2 => prop::collection::vec(any::<u8>(), 0..200).prop_map(Input::Bytes),
        3 => (cmd(), prop::collection::vec((0u16..1000, any::<u8>()), 1..6)).prop_map(|(c, f)| Input::Flipped(c, f)),
        1 => (prop_oneof![1u16..70, 60u16..=200], any::<bool>()).prop_map(|(d, o)| Input::Deep(d, o)),
        1 => prop_oneof![0u32..70_000, 60_000u32..200_000].prop_map(Input::Huge),
    ]
}

/// Appends what closes an open string and every open bracket, then a newline, so the next
/// input starts on fresh framing (a model of QMP's framing: nesting counted outside strings).
fn close(mut bytes: Vec<u8>) -> Vec<u8> {
    let (mut depth, mut in_string, mut escape) = (0usize, false, false);
    for &b in &bytes {
        if in_string {
            if escape {
                escape = false;
            } else if b == b'\\' {
                escape = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth = depth.saturating_sub(1),
            b'"' => in_string = true,
            _ => {}
        }
    }
    if escape {
        bytes.push(b'n');
    }
    if in_string {
        bytes.push(b'"');
    }
    bytes.extend(std::iter::repeat_n(b']', depth));
    bytes.push(b'\n');
    bytes
}

/// A client session.
struct Session {
    w: UnixStream,
    r: BufReader<UnixStream>,
    sync: u64,
    negotiated: bool,
}

impl Session {
    fn open() -> Self {
        let s = UnixStream::connect(server()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut me = Self {
            r: BufReader::new(s.try_clone().unwrap()),
            w: s,
            sync: 0,
            negotiated: false,
        };
        let g = me.line().expect("a greeting");
        assert!(g["QMP"]["version"]["qemu"].is_object(), "greeting {g}");
        me
    }

    /// The next line as JSON; `None` at end of stream. Panics after 5 s (a hang).
    fn line(&mut self) -> Option<Value> {
        let mut l = String::new();
        match self.r.read_line(&mut l) {
            Ok(0) => None,
            Ok(_) => Some(
                serde_json::from_str(l.trim_end())
                    .unwrap_or_else(|e| panic!("a reply that is not JSON ({e}): {l:?}")),
            ),
            Err(e) => panic!("no reply within 5 s (the monitor hangs): {e}"),
        }
    }

    fn send(&mut self, b: &[u8]) {
        self.w.write_all(b).expect("the monitor closed the session");
    }

    /// Sends a sync command and returns the replies that came before its answer (events
    /// left out), each checked to be QMP-shaped. The sync's answer must match the session
    /// state the model expects.
    fn sync(&mut self, what: &str) -> Vec<Value> {
        self.sync_with(what, true)
    }

    /// As [`Session::sync`]; with `strict` false the answer tells whether the input
    /// negotiated (random bytes may happen to hold a `qmp_capabilities`).
    fn sync_with(&mut self, what: &str, strict: bool) -> Vec<Value> {
        self.sync += 1;
        let id = format!("sync-{}", self.sync);
        self.send(format!("{{\"execute\": \"query-status\", \"id\": \"{id}\"}}\n").as_bytes());
        let mut got = Vec::new();
        loop {
            let v = self
                .line()
                .unwrap_or_else(|| panic!("{what}: the monitor closed the session"));
            let o = v
                .as_object()
                .unwrap_or_else(|| panic!("{what}: a reply that is not an object: {v}"));
            if o.contains_key("event") {
                assert!(
                    v["event"].is_string() && v["timestamp"].is_object(),
                    "{what}: {v}"
                );
                continue;
            }
            let shaped = (o.contains_key("return") && !o.contains_key("error"))
                || (v["error"]["class"].is_string() && v["error"]["desc"].is_string());
            assert!(shaped, "{what}: not a QMP reply: {v}");
            if v["id"] == json!(id) {
                if !strict && v.get("return").is_some() {
                    self.negotiated = true;
                }
                if self.negotiated {
                    assert_eq!(v["return"]["status"], "running", "{what}: {v}");
                } else {
                    assert_eq!(v["error"]["class"], "CommandNotFound", "{what}: {v}");
                }
                return got;
            }
            got.push(v);
        }
    }
}

/// Bytes of `c`, serialised compactly.
fn bytes_of(c: &Cmd) -> Vec<u8> {
    serde_json::to_vec(&c.to_value()).unwrap()
}

fn check_cmd(reply: &Value, c: &Cmd, want: Result<(), &str>, what: &str) {
    match want {
        Ok(()) => assert!(reply.get("return").is_some(), "{what}: {c:?} -> {reply}"),
        Err(class) => assert_eq!(reply["error"]["class"], class, "{what}: {c:?} -> {reply}"),
    }
    if let Some(id) = &c.id {
        assert_eq!(&reply["id"], id, "{what}: id not echoed: {reply}");
    }
}

/// Sends command `c` in pieces cut at `cuts` (per mille of its line), with pauses between
/// them, and checks the one reply against the model.
fn send_partial(s: &mut Session, c: &Cmd, cuts: &[u16], what: &str) {
    let want = c.expect(&mut s.negotiated);
    let mut b = bytes_of(c);
    b.push(b'\n');
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|&p| b.len() * usize::from(p) / 1000)
        .collect();
    at.sort_unstable();
    let mut from = 0;
    for cut in at.into_iter().chain([b.len()]) {
        s.send(&b[from..cut]);
        from = cut;
        std::thread::sleep(Duration::from_millis(1));
    }
    let r = s.sync(what);
    assert_eq!(r.len(), 1, "{what}: {c:?} -> {r:?}");
    check_cmd(&r[0], c, want, what);
}

/// Sends a command whose argument nests `d` arrays (or objects) and checks it is refused as too
/// deep exactly when it exceeds `MAX_NESTING`, otherwise answered as the model says.
fn send_deep(s: &mut Session, d: usize, objects: bool, what: &str) {
    let (open, shut) = if objects {
        ("{\"a\":".repeat(d), "}".repeat(d))
    } else {
        ("[".repeat(d), "]".repeat(d))
    };
    let inner = if objects { "1" } else { "" };
    let b =
        format!("{{\"execute\": \"query-kvm\", \"arguments\": {{\"x\": {open}{inner}{shut}}}}}\n");
    s.send(b.as_bytes());
    let r = s.sync(what);
    assert_eq!(r.len(), 1, "{what}: depth {d} -> {r:?}");
    // The command's own object and `arguments` are two more levels.
    let too_deep = d + 2 > MAX_NESTING;
    let (class, desc) = (&r[0]["error"]["class"], &r[0]["error"]["desc"]);
    if too_deep {
        assert_eq!(class, "GenericError", "{what}: depth {d} -> {r:?}");
        assert!(
            desc.as_str().unwrap().contains("levels of nesting"),
            "{what}: depth {d}: {desc}"
        );
    } else if s.negotiated {
        assert_eq!(desc, "Parameter 'x' is unexpected", "{what}: depth {d}");
    } else {
        assert_eq!(class, "CommandNotFound", "{what}: depth {d}");
    }
}

fn run_session(negotiate: bool, inputs: &[Input]) {
    let mut s = Session::open();
    if negotiate {
        s.send(b"{\"execute\": \"qmp_capabilities\"}\n");
        s.negotiated = true;
        assert!(s.sync("negotiation")[0]["return"].is_object());
    }
    for (i, inp) in inputs.iter().enumerate() {
        let what = format!("input {i}");
        match inp {
            Input::Cmd(c) => {
                let want = c.expect(&mut s.negotiated);
                let mut b = bytes_of(c);
                b.push(b'\n');
                s.send(&b);
                let r = s.sync(&what);
                assert_eq!(r.len(), 1, "{what}: {c:?} -> {r:?}");
                check_cmd(&r[0], c, want, &what);
            }
            Input::Partial(c, cuts) => send_partial(&mut s, c, cuts, &what),
            Input::Line(cs) => {
                let mut b = Vec::new();
                let wants: Vec<_> = cs.iter().map(|c| c.expect(&mut s.negotiated)).collect();
                for c in cs {
                    b.extend(bytes_of(c));
                }
                b.push(b'\n');
                s.send(&b);
                let r = s.sync(&what);
                assert_eq!(r.len(), cs.len(), "{what}: {cs:?} -> {r:?}");
                for ((c, want), reply) in cs.iter().zip(wants).zip(&r) {
                    check_cmd(reply, c, want, &what);
                }
            }
            Input::Json(v) => {
                s.send(&close(serde_json::to_vec(v).unwrap()));
                s.sync_with(&what, false);
            }
            Input::Bytes(b) => {
                s.send(&close(b.clone()));
                s.sync_with(&what, false);
            }
            Input::Flipped(c, flips) => {
                let mut b = bytes_of(c);
                for &(p, x) in flips {
                    let i = (b.len() * usize::from(p) / 1000).min(b.len() - 1);
                    b[i] = x;
                }
                s.send(&close(b));
                s.sync_with(&what, false);
            }
            Input::Deep(depth, objects) => send_deep(&mut s, usize::from(*depth), *objects, &what),
            Input::Huge(len) => {
                let body = "x".repeat(*len as usize);
                let b = format!("{{\"execute\": \"query-kvm\", \"id\": \"{body}\"}}\n");
                s.send(b.as_bytes());
                let r = s.sync(&what);
                assert_eq!(r.len(), 1, "{what}: {len} bytes -> {} replies", r.len());
                if b.len() - 1 > MAX_COMMAND_BYTES {
                    assert_eq!(r[0]["error"]["class"], "GenericError", "{what}");
                } else if s.negotiated {
                    assert_eq!(r[0]["return"]["enabled"], true, "{what}");
                    assert_eq!(r[0]["id"].as_str().map(str::len), Some(*len as usize));
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(bounce::testing::fuzz_config(256))]
    #[test]
    fn hostile_qmp_sessions_always_get_qmp_shaped_replies(
        negotiate in prop::bool::weighted(0.8),
        inputs in prop::collection::vec(input(), 1..12),
    ) {
        run_session(negotiate, &inputs);
    }
}
