//! The verify pattern: every 512-byte sector says where it belongs and which write put it
//! there, so a read that returns stale data (an older generation), misplaced data (another
//! offset) or garbage is told apart from good data.
//!
//! Sector layout (little endian):
//!
//! ```text
//! 0..8    device byte offset of the sector
//! 8..12   generation (1 for the first write of a block, +1 per rewrite; 0 is never written)
//! 12..16  low 32 bits of the run's seed (data of an earlier run never matches)
//! 16..512 62 words of splitmix64(seed, offset, generation, word index)
//! ```

use devices::block::SECTOR_SIZE;

const SECTOR: usize = SECTOR_SIZE as usize;

/// What a sector held instead of the expected pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// Device byte offset of the first sector that differs.
    pub offset: u64,
    /// The offset its header claims.
    pub found_offset: u64,
    /// The generation its header claims.
    pub found_gen: u32,
    /// Whether the header names this run (a wrong seed means foreign or never-written data).
    pub same_run: bool,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if !self.same_run {
            write!(
                f,
                "sector at byte {} holds data not written by this run",
                self.offset
            )
        } else if self.found_offset != self.offset {
            write!(
                f,
                "sector at byte {} holds the data of byte {} (generation {})",
                self.offset, self.found_offset, self.found_gen
            )
        } else {
            write!(
                f,
                "sector at byte {} holds generation {} with corrupted contents or a stale generation",
                self.offset, self.found_gen
            )
        }
    }
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The pattern of one run.
#[derive(Clone, Copy, Debug)]
pub struct Pattern {
    seed: u64,
}

impl Pattern {
    /// A pattern keyed by `seed`.
    pub fn new(seed: u64) -> Self {
        Self { seed }
    }

    /// Fills `buf` (a whole number of sectors) with the data of generation `gen` at device
    /// byte `offset`.
    pub fn fill(&self, buf: &mut [u8], offset: u64, gen: u32) {
        for (i, sector) in buf.chunks_exact_mut(SECTOR).enumerate() {
            let at = offset.wrapping_add(i as u64 * SECTOR_SIZE);
            sector[0..8].copy_from_slice(&at.to_le_bytes());
            sector[8..12].copy_from_slice(&gen.to_le_bytes());
            // The low half of the seed, by design.
            #[allow(clippy::cast_possible_truncation)]
            sector[12..16].copy_from_slice(&(self.seed as u32).to_le_bytes());
            let key = splitmix64(self.seed ^ at.rotate_left(17) ^ (u64::from(gen) << 40));
            for (w, word) in sector[16..].chunks_exact_mut(8).enumerate() {
                word.copy_from_slice(&splitmix64(key.wrapping_add(w as u64)).to_le_bytes());
            }
        }
    }

    /// Checks that `buf` holds generation `gen` at `offset`; `scratch` is reused for the
    /// expected data.
    ///
    /// # Errors
    /// The first sector that differs.
    pub fn check(
        &self,
        buf: &[u8],
        offset: u64,
        gen: u32,
        scratch: &mut Vec<u8>,
    ) -> Result<(), Mismatch> {
        scratch.resize(buf.len(), 0);
        self.fill(scratch, offset, gen);
        if buf == scratch.as_slice() {
            return Ok(());
        }
        for (i, (got, want)) in buf
            .chunks_exact(SECTOR)
            .zip(scratch.chunks_exact(SECTOR))
            .enumerate()
        {
            if got != want {
                let word = |r: std::ops::Range<usize>| {
                    let mut b = [0u8; 8];
                    b[..r.len()].copy_from_slice(&got[r]);
                    u64::from_le_bytes(b)
                };
                #[allow(clippy::cast_possible_truncation)]
                return Err(Mismatch {
                    offset: offset.wrapping_add(i as u64 * SECTOR_SIZE),
                    found_offset: word(0..8),
                    found_gen: word(8..12) as u32,
                    same_run: word(12..16) as u32 == self.seed as u32,
                });
            }
        }
        // Only a length difference is left, which fill() rules out.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_misplaced_foreign_and_corrupt_data_are_detected() {
        let p = Pattern::new(0x1234_5678_9abc);
        let mut scratch = Vec::new();
        let mut buf = vec![0u8; 4096];
        p.fill(&mut buf, 8192, 3);
        assert_eq!(p.check(&buf, 8192, 3, &mut scratch), Ok(()));
        // Stale: generation 3 where 4 is expected.
        let e = p.check(&buf, 8192, 4, &mut scratch).unwrap_err();
        assert_eq!((e.offset, e.found_gen, e.same_run), (8192, 3, true));
        // Misplaced: the data of another block.
        let e = p.check(&buf, 4096, 3, &mut scratch).unwrap_err();
        assert_eq!((e.offset, e.found_offset), (4096, 8192));
        // Foreign: another run's data.
        let e = Pattern::new(7)
            .check(&buf, 8192, 3, &mut scratch)
            .unwrap_err();
        assert!(!e.same_run);
        // One flipped bit in the third sector.
        buf[2 * 512 + 100] ^= 1;
        let e = p.check(&buf, 8192, 3, &mut scratch).unwrap_err();
        assert_eq!(e.offset, 8192 + 1024);
        assert!(e.to_string().contains("corrupted"), "{e}");
    }
}
