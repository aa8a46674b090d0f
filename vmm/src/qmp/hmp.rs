//! `human-monitor-command`: the few HMP commands bouncevm answers, as text rendered from the
//! same data as their QMP counterparts. `info registers` shows one vCPU (`cpu-index`, default
//! 0, as QEMU's monitor CPU), `info registers -a` all of them, both from `x-query-vcpus`.

use serde_json::{Map, Value};

use super::commands::generic;
use super::QmpContext;
use crate::vcpu::state::{query, QUERY_TIMEOUT};

/// Runs `human-monitor-command` with arguments `args`; the whole reply.
pub(super) fn human_monitor_command(args: &Map<String, Value>, ctx: &QmpContext) -> Value {
    let line = match args.get("command-line") {
        None => return generic("Parameter 'command-line' is missing"),
        Some(Value::String(s)) => s.as_str(),
        Some(_) => return generic("Invalid parameter type for 'command-line', expected: string"),
    };
    let cpu = match args.get("cpu-index") {
        None => 0,
        Some(v) => match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
            Some(n) if n < ctx.vcpus.len() => n,
            Some(_) => return generic("Parameter 'cpu-index' does not name a vCPU"),
            None => return generic("Invalid parameter type for 'cpu-index', expected: integer"),
        },
    };
    let words: Vec<&str> = line.split_whitespace().collect();
    let chosen = match words.as_slice() {
        ["info", "registers"] => ctx.vcpus.get(cpu..=cpu).unwrap_or_default(),
        ["info", "registers", "-a"] => &ctx.vcpus[..],
        _ => {
            // Quote at most a line's worth of what the client sent.
            let shown: String = line.chars().take(80).collect();
            return generic(format!(
                "unknown command: '{}' (bouncevm answers 'info registers [-a]')",
                shown.escape_default()
            ));
        }
    };
    let text: String = query(chosen, QUERY_TIMEOUT)
        .iter()
        .map(registers_text)
        .collect();
    serde_json::json!({ "return": text })
}

/// `n` in hexadecimal, `digits` wide; `-` when absent.
fn hex(v: &Value, digits: usize) -> String {
    v.as_u64()
        .map_or_else(|| "-".into(), |n| format!("{n:0digits$x}"))
}

/// 0/1 for a JSON boolean (`-` when absent).
fn flag(v: &Value) -> &'static str {
    match v.as_bool() {
        Some(true) => "1",
        Some(false) => "0",
        None => "-",
    }
}

/// One vCPU of `x-query-vcpus` as `info registers` text, lines ended by CR LF as QEMU's.
pub(super) fn registers_text(v: &Value) -> String {
    let mut out = Vec::new();
    out.push(format!(
        "CPU#{} thread-id={} thread-state={} mp-state={}",
        v["cpu-index"],
        v["thread-id"],
        v["thread-state"].as_str().unwrap_or("-"),
        v["mp-state"].as_str().unwrap_or("-"),
    ));
    if v["answered"] != Value::Bool(true) {
        out.push("(the vCPU thread did not answer: registers unavailable)".into());
    }
    let r = &v["regs"];
    if r.is_object() {
        for row in [
            ["rax", "rbx", "rcx", "rdx"],
            ["rsi", "rdi", "rbp", "rsp"],
            ["r8", "r9", "r10", "r11"],
            ["r12", "r13", "r14", "r15"],
        ] {
            let cells: Vec<String> = row
                .iter()
                .map(|n| format!("{:<3}={}", n.to_uppercase(), hex(&r[*n], 16)))
                .collect();
            out.push(cells.join(" "));
        }
        out.push(format!(
            "RIP={} RFL={} IF={}",
            hex(&r["rip"], 16),
            hex(&r["rflags"], 8),
            flag(&v["interrupts-enabled"])
        ));
    }
    let s = &v["sregs"];
    if s.is_object() {
        for seg in ["cs", "ss", "ds", "es", "fs", "gs", "tr", "ldt"] {
            let g = &s[seg];
            out.push(format!(
                "{:<3}={} {} {} type={} dpl={} p={} db={} l={}",
                seg.to_uppercase(),
                hex(&g["selector"], 4),
                hex(&g["base"], 16),
                hex(&g["limit"], 8),
                hex(&g["type"], 1),
                g["dpl"],
                flag(&g["present"]),
                flag(&g["db"]),
                flag(&g["l"]),
            ));
        }
        for t in ["gdt", "idt"] {
            out.push(format!(
                "{}=    {} {}",
                t.to_uppercase(),
                hex(&s[t]["base"], 16),
                hex(&s[t]["limit"], 8)
            ));
        }
        out.push(format!(
            "CR0={} CR2={} CR3={} CR4={} CR8={}",
            hex(&s["cr0"], 8),
            hex(&s["cr2"], 16),
            hex(&s["cr3"], 16),
            hex(&s["cr4"], 8),
            hex(&s["cr8"], 1)
        ));
        out.push(format!(
            "EFER={} APIC_BASE={}",
            hex(&s["efer"], 16),
            hex(&s["apic-base"], 16)
        ));
    }
    // The lines below are format arguments of different registers: alike in shape only.
    let e = &v["events"];
    if e.is_object() {
        let (i, n, x) = (&e["interrupt"], &e["nmi"], &e["exception"]);
        out.push(format!(
            "INT injected={} vector={} soft={} shadow={} | NMI injected={} pending={} masked={} | EXC injected={} pending={} vector={} error-code={} | SIPI vector={}",
            flag(&i["injected"]),
            hex(&i["vector"], 2),
            flag(&i["soft"]),
            i["shadow"],
            flag(&n["injected"]),
            flag(&n["pending"]),
            flag(&n["masked"]),
            flag(&x["injected"]),
            flag(&x["pending"]),
            hex(&x["vector"], 2),
            hex(&x["error-code"], 8),
            hex(&e["sipi-vector"], 2),
        ));
    }
    let l = &v["lapic"];
    if l.is_object() {
        out.push(format!(
            "LAPIC id={} TPR={} PPR={} SVR={} IRR-max={} ISR-max={} ESR={} ICR={}",
            l["id"],
            hex(&l["tpr"], 2),
            hex(&l["ppr"], 2),
            hex(&l["svr"], 8),
            hex(&l["irr-highest"], 2),
            hex(&l["isr-highest"], 2),
            hex(&l["esr"], 8),
            hex(&l["icr"], 16),
        ));
        out.push(format!(
            "LVTT={} TMICT={} TMCCT={} TDCR={} LINT0={} LINT1={} LVTERR={}",
            hex(&l["lvt-timer"], 8),
            hex(&l["timer-initial-count"], 8),
            hex(&l["timer-current-count"], 8),
            hex(&l["timer-divide"], 8),
            hex(&l["lvt-lint0"], 8),
            hex(&l["lvt-lint1"], 8),
            hex(&l["lvt-error"], 8),
        ));
    }
    let m = &v["msrs"];
    if m.is_object() {
        out.push(format!(
            "TSC={} TSC_DEADLINE={}",
            hex(&m["tsc"], 16),
            hex(&m["tsc-deadline"], 16)
        ));
    }
    if let Some(errors) = v["errors"].as_array() {
        for err in errors {
            out.push(format!("error: {}", err.as_str().unwrap_or("-")));
        }
    }
    if let Some(exits) = v["exits"].as_object() {
        let counts: Vec<String> = exits.iter().map(|(k, n)| format!("{k}={n}")).collect();
        out.push(format!(
            "EXITS {} | unhandled pio={} mmio={}",
            counts.join(" "),
            v["unhandled"]["pio"],
            v["unhandled"]["mmio"]
        ));
    }
    let mut text = out.join("\r\n");
    text.push_str("\r\n");
    text
}
