//! Trace files: opening (JSON lines or compact, plain or gzip, told apart by their magic
//! bytes) and iterating over their operations.

use std::fs::File;
use std::io::{BufRead, BufReader, Cursor, Read};
use std::path::Path;

use super::compact::{CompactReader, MAGIC};
use super::parse::{parse_line, TraceOp};
use super::{Result, TraceError};

/// Opens a trace file: JSON lines or a compact trace ([`super::compact`]), either one plain or
/// gzip-compressed, told apart by their first bytes.
///
/// # Errors
/// [`TraceError::Io`] when the file cannot be opened or read; [`TraceError::Compact`] when it
/// starts as a compact trace of another version.
pub fn open(path: &Path) -> Result<TraceFile> {
    let name = path.display().to_string();
    let io = |source| TraceError::Io {
        path: name.clone(),
        source,
    };
    let mut file = BufReader::with_capacity(1 << 20, File::open(path).map_err(io)?);
    let magic = file.fill_buf().map_err(io)?;
    let mut stream: Box<dyn BufRead> = if magic.starts_with(&[0x1f, 0x8b]) {
        Box::new(BufReader::with_capacity(
            1 << 20,
            flate2::read::MultiGzDecoder::new(file),
        ))
    } else {
        Box::new(file)
    };
    let mut head = Vec::with_capacity(MAGIC.len());
    (&mut stream)
        .take(MAGIC.len() as u64)
        .read_to_end(&mut head)
        .map_err(io)?;
    let compact = head == MAGIC;
    let stream: Box<dyn BufRead> = Box::new(Cursor::new(head).chain(stream));
    Ok(if compact {
        TraceFile::Compact(CompactReader::new(stream, name)?)
    } else {
        TraceFile::Json(TraceReader::new(stream, name))
    })
}

/// An open trace file ([`open`]): an iterator over its operations with their line numbers,
/// whatever its format.
pub enum TraceFile {
    /// JSON lines.
    Json(TraceReader<Box<dyn BufRead>>),
    /// A compact trace.
    Compact(CompactReader<Box<dyn BufRead>>),
}

impl std::fmt::Debug for TraceFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TraceFile::Json(r) => f.debug_tuple("Json").field(&r.name).finish(),
            TraceFile::Compact(r) => f.debug_tuple("Compact").field(&r.name()).finish(),
        }
    }
}

impl Iterator for TraceFile {
    type Item = Result<(u64, TraceOp)>;

    fn next(&mut self) -> Option<Self::Item> {
        match self {
            TraceFile::Json(r) => r.next(),
            TraceFile::Compact(r) => r.next(),
        }
    }
}

/// Iterates over the operations of a trace, with their 1-based line numbers.
#[derive(Debug)]
pub struct TraceReader<R> {
    inner: R,
    name: String,
    line_no: u64,
    buf: String,
}

impl<R: BufRead> TraceReader<R> {
    /// Reads operations from `inner`; `name` is used in error messages.
    pub fn new(inner: R, name: String) -> Self {
        Self {
            inner,
            name,
            line_no: 0,
            buf: String::new(),
        }
    }

    /// The text of the line the last item came from (the compact writer keeps a header's).
    pub fn last_line(&self) -> &str {
        &self.buf
    }
}

impl<R: Read> TraceReader<BufReader<R>> {
    /// Reads operations from an unbuffered reader.
    pub fn from_reader(inner: R, name: String) -> Self {
        Self::new(BufReader::new(inner), name)
    }
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<(u64, TraceOp)>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            self.buf.clear();
            match self.inner.read_line(&mut self.buf) {
                Ok(0) => return None,
                Ok(_) => {}
                // A truncated gzip stream or bytes that are not text end here: name the line
                // the reader was on.
                Err(source) => {
                    return Some(Err(TraceError::Invalid {
                        path: self.name.clone(),
                        line: self.line_no + 1,
                        reason: format!("cannot read it: {source}"),
                    }))
                }
            }
            self.line_no += 1;
            match parse_line(self.line_no, &self.buf) {
                Ok(None) => continue,
                Ok(Some(op)) => return Some(Ok((self.line_no, op))),
                Err(e) => return Some(Err(e)),
            }
        }
    }
}
