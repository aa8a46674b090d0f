//! Framing: a client's byte stream split into JSON values, bounded in size and nesting.

use super::{MAX_COMMAND_BYTES, MAX_NESTING};

/// One framed piece of client input.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Frame {
    /// A complete JSON value (or top-level garbage) to parse.
    Text(Vec<u8>),
    /// A value over [`MAX_COMMAND_BYTES`] or [`MAX_NESTING`], skipped.
    TooLarge,
}

/// Splits a byte stream into JSON values without holding more than [`MAX_COMMAND_BYTES`]:
/// tracks nesting outside strings; a top-level run of other characters ends at a newline
/// (so it can be answered as a syntax error and the session resynchronises).
#[derive(Debug, Default)]
pub(super) struct Framer {
    buf: Vec<u8>,
    depth: usize,
    in_string: bool,
    escape: bool,
    skipping: bool,
}

impl Framer {
    /// Takes one byte of input; values it completes are appended to `out`.
    pub(super) fn push(&mut self, b: u8, out: &mut Vec<Frame>) {
        if self.in_string {
            if self.escape {
                self.escape = false;
            } else if b == b'\\' {
                self.escape = true;
            } else if b == b'"' {
                self.in_string = false;
            }
            self.keep(b);
            return;
        }
        match b {
            b'{' | b'[' => {
                if self.depth == 0 && !self.buf.is_empty() {
                    // Garbage before a value.
                    out.push(Frame::Text(std::mem::take(&mut self.buf)));
                }
                self.depth += 1;
                if self.depth > MAX_NESTING {
                    self.skipping = true;
                }
                self.keep(b);
            }
            b'}' | b']' if self.depth > 0 => {
                self.depth -= 1;
                self.keep(b);
                if self.depth == 0 {
                    self.end(out);
                }
            }
            b'"' => {
                self.in_string = true;
                self.keep(b);
            }
            b'\n' if self.depth == 0 => {
                if !self.buf.iter().all(u8::is_ascii_whitespace) {
                    self.end(out);
                } else {
                    self.buf.clear();
                }
            }
            _ => self.keep(b),
        }
    }

    fn keep(&mut self, b: u8) {
        if self.skipping {
            return;
        }
        if self.buf.len() >= MAX_COMMAND_BYTES {
            self.skipping = true;
            self.buf = Vec::new();
            return;
        }
        self.buf.push(b);
    }

    fn end(&mut self, out: &mut Vec<Frame>) {
        if self.skipping {
            out.push(Frame::TooLarge);
        } else {
            out.push(Frame::Text(std::mem::take(&mut self.buf)));
        }
        self.buf.clear();
        self.skipping = false;
        self.in_string = false;
        self.escape = false;
        self.depth = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(input: &[u8]) -> Vec<Frame> {
        let mut f = Framer::default();
        let mut out = Vec::new();
        for &b in input {
            f.push(b, &mut out);
        }
        out
    }

    #[test]
    fn framer_splits_values_and_bounds_them() {
        let t = |s: &str| Frame::Text(s.as_bytes().to_vec());
        assert_eq!(
            frames(br#"{"a": "}{"}{"b": [1, {"c": "\""}]}"#),
            vec![t(r#"{"a": "}{"}"#), t(r#"{"b": [1, {"c": "\""}]}"#)]
        );
        assert_eq!(frames(b"garbage\n{}"), vec![t("garbage"), t("{}")]);
        assert_eq!(frames(b"  \r\n\n"), vec![]);
        let mut big = b"{\"execute\": \"".to_vec();
        big.resize(MAX_COMMAND_BYTES + 10, b'x');
        big.extend(b"\"}{}");
        assert_eq!(frames(&big), vec![Frame::TooLarge, t("{}")]);
        let deep = "[".repeat(MAX_NESTING + 1) + &"]".repeat(MAX_NESTING + 1);
        assert_eq!(frames(deep.as_bytes()), vec![Frame::TooLarge]);
    }
}
