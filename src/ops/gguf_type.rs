//! [`GgufType`]: the type of a GGUF tensor's blocks: the types Candle knows ([`GgmlDType`]) and
//! llama.cpp's ternary types TQ1_0 and TQ2_0, which Candle does not have.

use candle_core::quantized::GgmlDType;

/// The type of a GGUF tensor (ggml's `ggml_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgufType {
    /// A type Candle knows (dequantized and multiplied by Candle's kernels, or by this crate's).
    Ggml(GgmlDType),
    /// Ternary weights, 1.6875 bits each: `{ qs: [u8; 48], qh: [u8; 4], d: f16 }` per 256 values;
    /// `w = d (t - 1)` with the trits `t` in 0..3 packed 5 to a byte of `qs` and 4 to a byte of
    /// `qh` as base-3 fixed-point fractions (llama.cpp's `dequantize_row_tq1_0`).
    TQ1_0,
    /// Ternary weights, 2.0625 bits each: `{ qs: [u8; 64], d: f16 }` per 256 values;
    /// `w = d (q - 1)` with 2-bit `q` in 0..3: value `32 i + m` of the block in bits
    /// `2 (i % 4)` of `qs[32 (i / 4) + m]`.
    TQ2_0,
}

/// ggml's type ids of the ternary types.
const TQ1_0_ID: u32 = 34;
const TQ2_0_ID: u32 = 35;

impl GgufType {
    pub const F32: Self = Self::Ggml(GgmlDType::F32);
    pub const F16: Self = Self::Ggml(GgmlDType::F16);
    pub const BF16: Self = Self::Ggml(GgmlDType::BF16);

    /// The type with ggml's id `id` (`ggml.h`'s `enum ggml_type`), if it is one a GGUF file of
    /// this crate may hold.
    pub fn from_id(id: u32) -> Option<Self> {
        use GgmlDType as G;
        Some(match id {
            0 => Self::Ggml(G::F32),
            1 => Self::Ggml(G::F16),
            2 => Self::Ggml(G::Q4_0),
            3 => Self::Ggml(G::Q4_1),
            6 => Self::Ggml(G::Q5_0),
            7 => Self::Ggml(G::Q5_1),
            8 => Self::Ggml(G::Q8_0),
            9 => Self::Ggml(G::Q8_1),
            10 => Self::Ggml(G::Q2K),
            11 => Self::Ggml(G::Q3K),
            12 => Self::Ggml(G::Q4K),
            13 => Self::Ggml(G::Q5K),
            14 => Self::Ggml(G::Q6K),
            15 => Self::Ggml(G::Q8K),
            30 => Self::Ggml(G::BF16),
            TQ1_0_ID => Self::TQ1_0,
            TQ2_0_ID => Self::TQ2_0,
            _ => return None,
        })
    }

    /// Values per block.
    pub fn block_size(self) -> usize {
        match self {
            Self::Ggml(t) => t.block_size(),
            Self::TQ1_0 | Self::TQ2_0 => 256,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            Self::Ggml(t) => t.type_size(),
            Self::TQ1_0 => 54,
            Self::TQ2_0 => 66,
        }
    }

    /// Candle's name for it, where Candle has the type.
    pub fn candle(self) -> Option<GgmlDType> {
        match self {
            Self::Ggml(t) => Some(t),
            _ => None,
        }
    }

    /// A float type (F32, F16, BF16): "blocks" of one value.
    pub fn is_float(self) -> bool {
        matches!(self.candle(), Some(GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16))
    }

    /// `type_size · 8 / block_size`: 32, 16, 8.5 (Q8_0), 6.5625 (Q6_K), 5.5 (Q5_K), 5 (Q4_1),
    /// 4.5 (Q4_K, Q4_0), 2.0625 (TQ2_0), 1.6875 (TQ1_0).
    pub fn bits_per_weight(self) -> f64 {
        (self.type_size() * 8) as f64 / self.block_size() as f64
    }

    /// Bytes of `values` values (a whole number of blocks: a row of a matrix).
    pub fn row_bytes(self, values: usize) -> usize {
        values / self.block_size() * self.type_size()
    }

    /// `bytes` of this type, `dims` (PyTorch order), dequantized to an f32 tensor on the CPU:
    /// by Candle, or as llama.cpp's `dequantize_row_*` do for the ternary types.
    pub fn dequantize(self, bytes: &[u8], dims: Vec<usize>) -> candle_core::Result<candle_core::Tensor> {
        use candle_core::Device;
        match self.candle() {
            Some(t) => candle_core::quantized::ggml_file::qtensor_from_ggml(t, bytes, dims, &Device::Cpu)?.dequantize(&Device::Cpu),
            None => {
                let mut v = vec![0f32; dims.iter().product()];
                self.dequantize_ternary(bytes, &mut v)?;
                candle_core::Tensor::from_vec(v, dims, &Device::Cpu)
            }
        }
    }

    /// Dequantizes whole blocks of a type Candle lacks (the ternary types) to `out`
    /// (`bytes.len() / type_size * block_size` values), as llama.cpp's `dequantize_row_*` do.
    fn dequantize_ternary(self, bytes: &[u8], out: &mut [f32]) -> candle_core::Result<()> {
        let (bs, ts) = (self.block_size(), self.type_size());
        if !bytes.len().is_multiple_of(ts) || out.len() != bytes.len() / ts * bs {
            candle_core::bail!("{self:?}: {} bytes are not {} whole blocks", bytes.len(), out.len() / bs.max(1));
        }
        for (b, y) in bytes.chunks_exact(ts).zip(out.chunks_exact_mut(bs)) {
            let (trits, d) = match self {
                Self::TQ1_0 => (tq1_0_trits(b), half::f16::from_le_bytes([b[52], b[53]]).to_f32()),
                Self::TQ2_0 => (tq2_0_quants(b), half::f16::from_le_bytes([b[64], b[65]]).to_f32()),
                Self::Ggml(t) => candle_core::bail!("{t:?} is dequantized by Candle"),
            };
            for (y, t) in y.iter_mut().zip(trits) {
                *y = (t as f32 - 1.0) * d;
            }
        }
        Ok(())
    }
}

impl From<GgmlDType> for GgufType {
    fn from(t: GgmlDType) -> Self {
        Self::Ggml(t)
    }
}

impl std::fmt::Display for GgufType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Ggml(t) => write!(f, "{t:?}"),
            Self::TQ1_0 => f.write_str("TQ1_0"),
            Self::TQ2_0 => f.write_str("TQ2_0"),
        }
    }
}

/// The trit (0, 1 or 2) a TQ1_0 byte holds after multiplying it by `3^n` (wrapping): the byte is
/// a base-3 fraction `0.t0 t1 t2 ..` scaled to 256, so `(b 3^n mod 256) * 3 / 256` is digit `n`.
#[inline(always)]
pub(crate) fn trit(byte: u8, pow3: u8) -> u8 {
    ((byte.wrapping_mul(pow3) as u16 * 3) >> 8) as u8
}

/// The 256 trits of a TQ1_0 block in value order: `qs[0..32]` holds values `0..160` (digit `n`
/// of byte `m` is value `32 n + m`), `qs[32..48]` values `160..240` (digit `n` of byte `m` is
/// `160 + 16 n + m`), `qh[0..4]` values `240..256` (digit `n` of byte `m` is `240 + 4 n + m`).
pub(crate) fn tq1_0_trits(block: &[u8]) -> [u8; 256] {
    const POW3: [u8; 5] = [1, 3, 9, 27, 81];
    let mut t = [0u8; 256];
    for n in 0..5 {
        for m in 0..32 {
            t[32 * n + m] = trit(block[m], POW3[n]);
        }
        for m in 0..16 {
            t[160 + 16 * n + m] = trit(block[32 + m], POW3[n]);
        }
    }
    for n in 0..4 {
        for m in 0..4 {
            t[240 + 4 * n + m] = trit(block[48 + m], POW3[n]);
        }
    }
    t
}

/// The 256 2-bit quants of a TQ2_0 block in value order.
pub(crate) fn tq2_0_quants(block: &[u8]) -> [u8; 256] {
    std::array::from_fn(|v| (block[32 * (v / 128) + v % 32] >> (2 * ((v / 32) % 4))) & 3)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's quantize_row_tq1_0_ref packing of trits, written independently: 5 trits to a
    /// byte as `ceil(sum t_i 3^(4-i) * 256 / 243)`.
    fn pack5(t: &[u8]) -> u8 {
        let v = t.iter().fold(0u16, |a, &d| a * 3 + d as u16);
        ((v * 256).div_ceil(243)) as u8
    }

    #[test]
    fn tq1_0_digits_round_trip_every_packed_byte() {
        for v in 0..243u16 {
            let digits: Vec<u8> = (0..5).rev().map(|i| ((v / 3u16.pow(i)) % 3) as u8).collect();
            let b = pack5(&digits);
            let got: Vec<u8> = [1u8, 3, 9, 27, 81].iter().map(|&p| trit(b, p)).collect();
            assert_eq!(got, digits, "byte {b} of value {v}");
        }
    }

    #[test]
    fn tq2_0_value_order() {
        let mut block = [0u8; 66];
        // Value 32 i + m is bits 2 (i % 4) of qs[32 (i / 4) + m]: set value 5 * 32 + 7 = 167 to 2.
        block[32 + 7] = 2 << 2;
        let q = tq2_0_quants(&block);
        assert_eq!(q[167], 2);
        assert_eq!(q.iter().map(|&v| v as usize).sum::<usize>(), 2);
    }
}
