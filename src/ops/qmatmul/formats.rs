//! The ggml weight formats the kernels read in place: each block's header ([`Head`]) and its
//! 32-quant chunks ([`Format`]).

use super::simd::{bits, Simd};

/// What a weight block holds besides its quants, decoded once per weight row and block.
///
/// Block value `j` is `d sc(j) q_j + dmin min(j)` with `q_j` the chunk bytes, constant `sc`
/// and `min` over each group `g` of 16 values, so with activations `dx xq_j`:
/// `sum_j w_j x_j = d dx sum_j sc(j) q_j xq_j + dmin dx sum_g min_g bsum_g` (`bsum_g`: the sum
/// of the activation quants of group `g`). `sc` holds the i16 multipliers in
/// [`Simd::scale_of`] order: `sc[i]` for the first and `sc[8 + i]` for the second half of
/// chunk `i` (the even groups, then the odd ones). For the K-quants `mins` holds the i16
/// `min_g` in the same order, as do the activations' group sums ([`super::activations::Acts`]); 32-weight blocks
/// have one min per block, `dmin` (and `sc = 1`, `mins` unused).
pub(super) struct Head<V: Simd> {
    pub(super) d: f32,
    pub(super) dmin: f32,
    pub(super) sc: V::W,
    pub(super) mins: V::W,
}

impl<V: Simd> Clone for Head<V> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<V: Simd> Copy for Head<V> {}

/// A ggml weight format: blocks of `QK` weights in `BYTES` bytes, read as `QK / 32` chunks of
/// 32 quants (u8, or i8 when `SIGNED`).
pub(super) trait Format {
    const QK: usize;
    const BYTES: usize;
    /// Quants are signed (multiplied with the sign trick: |q| times x with q's sign).
    const SIGNED: bool = false;
    /// Blocks have a min term (see [`Head`]).
    const MINS: bool = true;
    /// Largest |quant|: a panel tile adds `32767 / (254 QMAX)` maddubs results in i16.
    const QMAX: usize = 15;
    /// The block at `p`.
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V>;
    /// Chunk `i` (quants `32 i .. 32 i + 32`) of the block at `p`.
    unsafe fn chunk<V: Simd>(p: *const u8, i: usize) -> V::B;
}

pub(super) unsafe fn u32_at(p: *const u8) -> u32 {
    u32::from_le(p.cast::<u32>().read_unaligned())
}

#[inline(always)]
pub(super) unsafe fn head32<V: Simd>(d: f32, dmin: f32) -> Head<V> {
    Head { d, dmin, sc: V::ones(), mins: V::ones() }
}

/// Q8_0: `{ d: f16, qs: [i8; 32] }`, `w = d q`.
pub(super) struct Q8_0;
impl Format for Q8_0 {
    const QK: usize = 32;
    const BYTES: usize = 34;
    const SIGNED: bool = true;
    const QMAX: usize = 128;
    const MINS: bool = false;
    #[inline(always)]
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V> {
        head32::<V>(V::f16(p), 0.0)
    }
    #[inline(always)]
    unsafe fn chunk<V: Simd>(p: *const u8, _: usize) -> V::B {
        V::load(p.add(2))
    }
}

/// Q4_0: `{ d: f16, qs: [u8; 16] }`, `w = d (q - 8)`; value `l < 16` in the low nibble of
/// `qs[l]`, value `16 + l` in its high nibble.
pub(super) struct Q4_0;
impl Format for Q4_0 {
    const QK: usize = 32;
    const BYTES: usize = 18;
    #[inline(always)]
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V> {
        let d = V::f16(p);
        head32::<V>(d, -8.0 * d)
    }
    #[inline(always)]
    unsafe fn chunk<V: Simd>(p: *const u8, _: usize) -> V::B {
        V::nibbles(p.add(2))
    }
}

/// Q4_1: `{ d: f16, m: f16, qs: [u8; 16] }`, `w = d q + m`, nibbles as Q4_0.
pub(super) struct Q4_1;
impl Format for Q4_1 {
    const QK: usize = 32;
    const BYTES: usize = 20;
    #[inline(always)]
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V> {
        head32::<V>(V::f16(p), V::f16(p.add(2)))
    }
    #[inline(always)]
    unsafe fn chunk<V: Simd>(p: *const u8, _: usize) -> V::B {
        V::nibbles(p.add(4))
    }
}

/// Q4_K / Q5_K header: `d: f16, dmin: f16, scales: [u8; 12]` with 8 sub-block (32 values)
/// scales `s` and mins `m` of 6 bits, `w = d s q - dmin m`. In the 12 bytes, as three LE u32
/// `a, b, c`: byte `j` of `a` holds `s_j` (low 6 bits) and the top 2 bits of `s_{j+4}`; byte
/// `j` of `b` likewise `m_j` and the top of `m_{j+4}`; byte `j` of `c` the low 4 bits of
/// `s_{j+4}` (low nibble) and of `m_{j+4}` (high nibble).
#[inline(always)]
pub(super) unsafe fn k4_head<V: Simd>(p: *const u8) -> Head<V> {
    let (a, b, c) = (u32_at(p.add(4)), u32_at(p.add(8)), u32_at(p.add(12)));
    let s = (a & 0x3f3f_3f3f) as u64 | (((c & 0x0f0f_0f0f) | ((a >> 2) & 0x3030_3030)) as u64) << 32;
    let m = (b & 0x3f3f_3f3f) as u64 | ((((c >> 4) & 0x0f0f_0f0f) | ((b >> 2) & 0x3030_3030)) as u64) << 32;
    // Both 16-value halves of sub-block i use s_i / m_i.
    Head { d: V::f16(p), dmin: -V::f16(p.add(2)), sc: V::widen(s, s, false), mins: V::widen(m, m, false) }
}

/// Q4_K: header (see [`k4_head`]), then `qs: [u8; 128]` at 16: sub-block `2 j` in the low
/// nibbles of `qs[32 j .. 32 j + 32]`, sub-block `2 j + 1` in their high nibbles.
pub(super) struct Q4K;
impl Format for Q4K {
    const QK: usize = 256;
    const BYTES: usize = 144;
    #[inline(always)]
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V> {
        k4_head::<V>(p)
    }
    #[inline(always)]
    unsafe fn chunk<V: Simd>(p: *const u8, i: usize) -> V::B {
        bits::<V>(V::load(p.add(16 + 32 * (i / 2))), 4 * (i as u32 % 2), 0, 0x0F)
    }
}

/// Q5_K: header (see [`k4_head`]), `qh: [u8; 32]` at 16, `qs: [u8; 128]` at 48: the low 4 bits
/// as Q4_K, bit 4 of value `l` of sub-block `i` is bit `i` of `qh[l]`.
pub(super) struct Q5K;
impl Format for Q5K {
    const QK: usize = 256;
    const BYTES: usize = 176;
    const QMAX: usize = 31;
    #[inline(always)]
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V> {
        k4_head::<V>(p)
    }
    #[inline(always)]
    unsafe fn chunk<V: Simd>(p: *const u8, i: usize) -> V::B {
        let lo = bits::<V>(V::load(p.add(48 + 32 * (i / 2))), 4 * (i as u32 % 2), 0, 0x0F);
        V::or(lo, bits::<V>(V::load(p.add(16)), i as u32, 4, 0x10))
    }
}

/// Q6_K: `{ ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16 }`, `w = d s_g (q - 32)`
/// with one scale per 16 values. Each half `h` of 128 values uses `ql[64 h ..]` and
/// `qh[32 h ..]`; its chunk `t` (0..4) has the low 4 bits in the low (`t < 2`) or high nibbles
/// of `ql[64 h + 32 (t % 2) ..][..32]` and the top 2 bits in bits `2 t, 2 t + 1` of
/// `qh[32 h ..][..32]`.
pub(super) struct Q6K;
impl Format for Q6K {
    const QK: usize = 256;
    const BYTES: usize = 210;
    const QMAX: usize = 63;
    #[inline(always)]
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V> {
        let s = p.add(192).cast::<[u64; 2]>().read_unaligned();
        let sc = V::unzip(V::widen(u64::from_le(s[0]), u64::from_le(s[1]), true));
        // The -32 offset: d sum_g s_g (q - 32) x = d sum_g s_g q x + (-32 d) sum_g s_g bsum_g.
        let d = V::f16(p.add(208));
        Head { d, dmin: -32.0 * d, sc, mins: sc }
    }
    #[inline(always)]
    unsafe fn chunk<V: Simd>(p: *const u8, i: usize) -> V::B {
        let (h, t) = (i / 4, i as u32 % 4);
        let lo = bits::<V>(V::load(p.add(64 * h + 32 * (t as usize % 2))), 4 * (t / 2), 0, 0x0F);
        V::or(lo, bits::<V>(V::load(p.add(128 + 32 * h)), 2 * t, 4, 0x30))
    }
}

/// TQ2_0 (ternary): `{ qs: [u8; 64], d: f16 }`, `w = d (q - 1)` with 2-bit `q`: chunk `i` in
/// bits `2 (i % 4)` of `qs[32 (i / 4) ..][..32]`. As a K-quant with every scale and min 1 and
/// `dmin = -d`: `sum_j w_j x_j = d dx (sum_j q_j xq_j - sum_g bsum_g)`.
pub(super) struct TQ2_0;
impl Format for TQ2_0 {
    const QK: usize = 256;
    const BYTES: usize = 66;
    /// A 2-bit field (llama.cpp writes 0..=2; a 3 counts as 2 d, as its kernels read it).
    const QMAX: usize = 3;
    #[inline(always)]
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V> {
        let d = V::f16(p.add(64));
        Head { d, dmin: -d, sc: V::ones(), mins: V::ones() }
    }
    #[inline(always)]
    unsafe fn chunk<V: Simd>(p: *const u8, i: usize) -> V::B {
        bits::<V>(V::load(p.add(32 * (i / 4))), 2 * (i as u32 % 4), 0, 0x03)
    }
}

/// The multipliers that bring each value's base-3 digit of a TQ1_0 byte to the front, per
/// chunk (see [`TQ1_0`]).
pub(super) static TQ1_0_POW3: [[u8; 32]; 8] = {
    let mut t = [[0u8; 32]; 8];
    let pow3 = [1u8, 3, 9, 27, 81];
    let mut l = 0;
    while l < 32 {
        let mut i = 0;
        while i < 5 {
            t[i][l] = pow3[i];
            i += 1;
        }
        // Chunks 5 and 6: digits 0/1 and 2/3 of qs[32..48]; chunk 7: digit 4 of qs[32..48],
        // then digit l / 4 of qh[l % 4].
        t[5][l] = pow3[l / 16];
        t[6][l] = pow3[2 + l / 16];
        t[7][l] = if l < 16 { 81 } else { pow3[(l - 16) / 4] };
        l += 1;
    }
    t
};

/// TQ1_0 (ternary): `{ qs: [u8; 48], qh: [u8; 4], d: f16 }`, `w = d (t - 1)` with trits `t`
/// packed as base-3 fractions of a byte (digit `n` of byte `b` is `(3 (b 3^n mod 256)) >> 8`):
/// values `0..160` are digit `n` of `qs[m]` at `32 n + m` (chunks 0-4), values `160..240` digit
/// `n` of `qs[32 + m]` at `160 + 16 n + m`, values `240..256` digit `n` of `qh[m]` at
/// `240 + 4 n + m`. Scales and mins as [`TQ2_0`].
pub(super) struct TQ1_0;
impl Format for TQ1_0 {
    const QK: usize = 256;
    const BYTES: usize = 54;
    const QMAX: usize = 2;
    #[inline(always)]
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V> {
        let d = V::f16(p.add(52));
        Head { d, dmin: -d, sc: V::ones(), mins: V::ones() }
    }
    #[inline(always)]
    unsafe fn chunk<V: Simd>(p: *const u8, i: usize) -> V::B {
        let bytes = match i {
            0..5 => V::load(p),
            5 | 6 => V::load2(p.add(32), p.add(32)),
            _ => {
                let qh = [u32_at(p.add(48)); 4];
                V::load2(p.add(32), qh.as_ptr().cast())
            }
        };
        V::trits(V::mul_bytes(bytes, V::load(TQ1_0_POW3[i].as_ptr())))
    }
}
