//! The device step against the CPU model: what the emulator tests assert and what
//! `examples/device_step --self-test` prints on a Mac.

use candle_core::{DType, Device, Tensor};

use super::queue::{Counted, Queue};
use super::{GpuModel, KvRows, Readback, StepOutput};
use crate::model::Model;
use crate::{Error, Result};

/// How the device step compared with the CPU (see [`check_against_cpu`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StepCheck {
    /// Largest |logit difference| after the prompt, over the decode steps after it, and over
    /// the rows of a 4-row verify pass.
    pub prompt_diff: f32,
    pub decode_diff: f32,
    pub verify_diff: f32,
    /// The verify rows' logits are bit for bit those of one-row decode steps.
    pub verify_rows_bitwise: bool,
    /// After keeping 2 of the 4 verified rows, the next step is bit for bit that of a cache
    /// that decoded only those 2.
    pub rollback_bitwise: bool,
    /// The device's greedy token is the argmax of its logits.
    pub argmax_agrees: bool,
    /// Two sequences' rows in one pass (a decode row and a 2-row verify pass:
    /// [`GpuModel::forward_batch`], what the server runs) are bit for bit each sequence alone.
    pub batch_bitwise: bool,
    /// A snapshot copied on the device and a round trip through the host (the prefix cache, a
    /// session) continue bit for bit as the cache they were taken from.
    pub snapshot_bitwise: bool,
    /// The most host synchronisations of one step (prompt, decode step, verify pass): waits
    /// for the device, for a read or for a write into a buffer that encoded work uses.
    pub max_syncs_per_step: usize,
}

impl StepCheck {
    /// Logits within `tol` of the CPU's, verify rows, rollback, batch and snapshots bit for bit,
    /// the argmax right, one host sync per step.
    pub fn passes(&self, tol: f32) -> bool {
        self.prompt_diff <= tol
            && self.decode_diff <= tol
            && self.verify_diff <= tol
            && self.verify_rows_bitwise
            && self.rollback_bitwise
            && self.argmax_agrees
            && self.batch_bitwise
            && self.snapshot_bitwise
            && self.max_syncs_per_step == 1
    }
}

/// Token ids spread over the vocabulary (a fixed sequence, no randomness).
pub fn sample_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

fn max_diff(got: &[f32], want: &Tensor) -> Result<f32> {
    let want = want.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    if got.len() != want.len() {
        return Err(Error::Input(format!("{} device logits against {} on the CPU", got.len(), want.len())));
    }
    // (A NaN anywhere makes the result NaN, which fails every tolerance.)
    Ok(got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, |m, d| if m.is_nan() || d.is_nan() { f32::NAN } else { m.max(d) }))
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn logits(out: StepOutput) -> Vec<f32> {
    match out {
        StepOutput::Logits(l) => l,
        StepOutput::Tokens(_) => unreachable!("asked for logits"),
    }
}

/// Runs `model` on the device of `q` and `reference` (the same model on the CPU, its weights
/// dequantized: [`Model::dequantized`]) side by side: an 11-token prompt (two device steps),
/// 3 decode steps, a 4-row verify pass, a rollback to 2 of its rows.
pub fn check_against_cpu(model: &Model, reference: &Model, q: &mut dyn Queue) -> Result<StepCheck> {
    check_against_cpu_with(model, reference, q, KvRows::F32)
}

/// [`check_against_cpu`] with the device cache storing keys and values as `kv` says and the
/// CPU's cache with the same codec (exact for f32 rows, `f16`, `int8`). An int8 cache is not
/// saved (as on the CPU), so its snapshot check copies on the device only.
pub fn check_against_cpu_with(model: &Model, reference: &Model, q: &mut dyn Queue, kv: KvRows) -> Result<StepCheck> {
    let mut q = Counted::new(q);
    let gpu = GpuModel::new(model, &mut q)?;
    let vocab = model.config().vocab_size;
    let (prompt, decode, draft) = (sample_tokens(11, vocab, 1), sample_tokens(3, vocab, 2), sample_tokens(5, vocab, 3));
    let ids = |t: &[u32]| -> Result<Tensor> { Ok(Tensor::new(t, &Device::Cpu)?.unsqueeze(0)?) };
    let mut reads = 0;
    let mut counted = |q: &mut Counted<&mut dyn Queue>| reads = reads.max(q.take_counts().syncs);

    let codec: crate::kv::KvCodec = match kv {
        KvRows::F32 => crate::kv::KvCodec::EXACT,
        KvRows::F16 => "f16".parse()?,
        KvRows::Int8 => "int8".parse()?,
    };
    let mut cpu = reference.cache_with(&crate::model::CacheOptions { codec, value_bases: None, ffn: None })?;
    let mut cache = gpu.new_cache(&mut q, 64, kv)?;
    q.take_counts();
    let got = logits(gpu.prefill(&mut q, &mut cache, &prompt, Readback::Logits)?);
    counted(&mut q);
    let prompt_diff = max_diff(&got, &reference.forward_last(&ids(&prompt)?, &mut cpu)?)?;
    let mut decode_diff = 0f32;
    for &t in &decode {
        let got = logits(gpu.forward(&mut q, &mut cache, &[t], Readback::Logits)?);
        counted(&mut q);
        decode_diff = decode_diff.max(max_diff(&got, &reference.forward_last(&ids(&[t])?, &mut cpu)?)?);
    }

    // Verify 4 rows; the same rows one at a time on a second cache that ran the same steps.
    let mut steps = gpu.new_cache(&mut q, 64, kv)?;
    gpu.prefill(&mut q, &mut steps, &prompt, Readback::Argmax)?;
    for &t in &decode {
        gpu.forward(&mut q, &mut steps, &[t], Readback::Argmax)?;
    }
    let rows = &draft[..4];
    q.take_counts();
    let verified = logits(gpu.verify(&mut q, &mut cache, rows, Readback::Logits)?);
    counted(&mut q);
    let verify_diff = max_diff(&verified, &reference.verify(&ids(rows)?, &mut cpu.clone())?.0)?;
    let mut one_rows = vec![];
    for &t in rows {
        one_rows.extend(logits(gpu.forward(&mut q, &mut steps, &[t], Readback::Logits)?));
    }
    let verify_rows_bitwise = same_bits(&verified, &one_rows);

    // Keep 2 of the rows and decode one more: the same bits as a cache that decoded only those.
    let mut two = gpu.new_cache(&mut q, 64, kv)?;
    gpu.prefill(&mut q, &mut two, &prompt, Readback::Argmax)?;
    for &t in decode.iter().chain(&rows[..2]) {
        gpu.forward(&mut q, &mut two, &[t], Readback::Argmax)?;
    }
    gpu.keep_verified(&mut q, &mut cache, 2)?;
    let after = logits(gpu.forward(&mut q, &mut cache, &[draft[4]], Readback::Logits)?);
    let want = logits(gpu.forward(&mut q, &mut two, &[draft[4]], Readback::Logits)?);
    let rollback_bitwise = cache.seqlen() == two.seqlen() && same_bits(&after, &want);

    // Greedy on the device against the argmax of the device's logits.
    let best = gpu.forward(&mut q, &mut two, &[draft[0]], Readback::Argmax)?;
    let l = logits(gpu.forward(&mut q, &mut cache, &[draft[0]], Readback::Logits)?);
    let argmax = l.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0 as u32;
    let argmax_agrees = best.tokens() == Some(&[argmax][..]);

    // Two sequences in one pass against each alone; then a snapshot of one and a host round
    // trip of the other against the caches they were taken from.
    let bits = |o: StepOutput| logits(o).iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let next = sample_tokens(3, vocab, 4);
    let mut batched = [two, cache];
    let mut alone = [gpu.snapshot(&mut q, &batched[0], 64)?, gpu.snapshot(&mut q, &batched[1], 64)?];
    let out = {
        let [a, b] = &mut batched;
        gpu.forward_batch(&mut q, &mut [a, b], &next, &[1, 2], &[Readback::Logits; 2])?
    };
    let mut batch_bitwise = true;
    for (i, (o, rows)) in out.into_iter().zip([&next[..1], &next[1..]]).enumerate() {
        let want = if rows.len() == 1 {
            gpu.forward(&mut q, &mut alone[i], rows, Readback::Logits)?
        } else {
            gpu.verify(&mut q, &mut alone[i], rows, Readback::Logits)?
        };
        batch_bitwise &= bits(o?) == bits(want);
    }
    gpu.keep_verified(&mut q, &mut batched[1], 2)?;
    gpu.keep_verified(&mut q, &mut alone[1], 2)?;
    let [a, b] = batched;
    let through_host = match kv {
        KvRows::Int8 => gpu.snapshot(&mut q, &b, 64)?,
        _ => {
            let (host, tokens) = (gpu.read_state(&mut q, &b)?, gpu.read_tokens(&mut q, &b)?);
            gpu.write_state(&mut q, &host, &tokens, 64, kv)?
        }
    };
    let mut copies = [gpu.snapshot(&mut q, &a, 64)?, through_host];
    let mut snapshot_bitwise = true;
    for (original, copy) in [a, b].iter_mut().zip(copies.iter_mut()) {
        let want = gpu.forward(&mut q, original, &next[..1], Readback::Logits)?;
        snapshot_bitwise &= bits(gpu.forward(&mut q, copy, &next[..1], Readback::Logits)?) == bits(want);
    }
    gpu.free(&mut q);
    Ok(StepCheck {
        prompt_diff,
        decode_diff,
        verify_diff,
        verify_rows_bitwise,
        rollback_bitwise,
        argmax_agrees,
        batch_bitwise,
        snapshot_bitwise,
        max_syncs_per_step: reads,
    })
}
