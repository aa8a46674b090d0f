//! Trace files: opening (plain or gzip, by magic) and iterating over their operations.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use super::parse::{parse_line, TraceOp};
use super::{Result, TraceError};

/// Opens a trace file, transparently decompressing gzip.
///
/// # Errors
/// [`TraceError::Io`] when the file cannot be opened or read.
pub fn open(path: &Path) -> Result<TraceReader<Box<dyn BufRead>>> {
    let io = |source| TraceError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut file = BufReader::with_capacity(1 << 20, File::open(path).map_err(io)?);
    let magic = file.fill_buf().map_err(io)?;
    let reader: Box<dyn BufRead> = if magic.starts_with(&[0x1f, 0x8b]) {
        Box::new(BufReader::with_capacity(
            1 << 20,
            flate2::read::MultiGzDecoder::new(file),
        ))
    } else {
        Box::new(file)
    };
    Ok(TraceReader::new(reader, path.display().to_string()))
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
                Err(source) => {
                    return Some(Err(TraceError::Io {
                        path: self.name.clone(),
                        source,
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
