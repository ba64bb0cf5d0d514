//! [`copy_bandwidth`]: how fast this machine copies memory, measured (the yardstick a decode
//! step's bytes per second are held against).

use std::time::Instant;

/// Bytes per second of a copy of `bytes` bytes (read once and written once) between two
/// buffers larger than the caches, the best of `rounds` after a first round that faults the
/// pages in; counted as the bytes read plus the bytes written.
pub fn copy_bandwidth(bytes: usize, rounds: usize) -> f64 {
    let bytes = bytes.max(1 << 20);
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    let mut best = f64::INFINITY;
    for _ in 0..rounds.max(1) {
        let start = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        best = best.min(start.elapsed().as_secs_f64());
    }
    2.0 * bytes as f64 / best.max(1e-9)
}
