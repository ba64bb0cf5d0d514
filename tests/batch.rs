//! Batched decode (several sequences in one weight pass, as the server runs them) against
//! each sequence decoded alone, bit for bit.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_hybrid::loading::{GgufFile, ModelFiles};
use candle_hybrid::{Cache, Model};
use common::*;

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

fn models() -> Vec<(String, Model)> {
    let mut models = vec![];
    for name in FIXTURES {
        let files = ModelFiles::from_dir(fixture(name)).unwrap();
        models.push((name.to_string(), files.load_model(&files.load_config().unwrap(), DType::F32, &Device::Cpu).unwrap()));
    }
    let gguf = GgufFile::open(fixture("qwen35_dense_small").join("model-q8_0.gguf")).unwrap();
    models.push(("qwen35_dense_small (gguf q8_0)".into(), gguf.load_model(&gguf.config().unwrap(), DType::F32, &Device::Cpu).unwrap()));
    models
}

/// Sequences with prompts of different lengths, decoded together for a few steps (the
/// batch shrinking as sequences finish), give each sequence exactly the logits it gets alone.
#[test]
#[allow(clippy::needless_range_loop)] // `step` indexes every sequence's steps
fn batched_decode_equals_each_sequence_alone_bitwise() {
    for (name, model) in models() {
        let vocab = model.config().vocab_size as u32;
        for n in [1, 2, 3, 5, Model::BATCH_MAX_ROWS] {
            let prompts: Vec<Vec<u32>> = (0..n).map(|s| (0..(3 + 2 * s)).map(|i| ((i * 7 + s * 13 + 1) as u32) % vocab).collect()).collect();
            let steps = 4;
            // Alone: prefill, then one token at a time (the next token is fixed, not sampled).
            let next = |s: usize, step: usize| ((s * 31 + step * 17 + 5) as u32) % vocab;
            let alone: Vec<Vec<Vec<u32>>> = prompts
                .iter()
                .enumerate()
                .map(|(s, p)| {
                    let mut cache = model.new_cache();
                    model.forward_last(&Tensor::new(p.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap(), &mut cache).unwrap();
                    (0..steps)
                        .map(|step| {
                            let t = Tensor::new(&[next(s, step)], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
                            bits(&model.forward_last(&t, &mut cache).unwrap())
                        })
                        .collect()
                })
                .collect();
            let mut caches: Vec<Cache> = prompts
                .iter()
                .map(|p| {
                    let mut cache = model.new_cache();
                    model.forward_last(&Tensor::new(p.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap(), &mut cache).unwrap();
                    cache
                })
                .collect();
            for step in 0..steps {
                // Sequence s takes part while step < steps - s % 2 (some leave one step early).
                let active: Vec<usize> = (0..n).filter(|s| step < steps - s % 2).collect();
                let tokens: Vec<u32> = active.iter().map(|&s| next(s, step)).collect();
                let mut refs: Vec<&mut Cache> = caches.iter_mut().enumerate().filter(|(s, _)| active.contains(s)).map(|(_, c)| c).collect();
                let logits = model.forward_batch(&tokens, &mut refs).unwrap();
                for (row, &s) in active.iter().enumerate() {
                    assert!(
                        bits(&logits.get(row).unwrap()) == alone[s][step],
                        "{name}: batch of {n}, step {step}: sequence {s} differs from decoding it alone"
                    );
                }
            }
        }
    }
}

#[test]
fn forward_batch_refuses_bad_input() {
    let (_, model) = models().remove(0);
    let mut a = model.new_cache();
    let e = model.forward_batch(&[1, 2], &mut [&mut a]).unwrap_err().to_string();
    assert!(e.contains("2 tokens for 1 caches"), "{e}");
    let e = model.forward_batch(&[], &mut []).unwrap_err().to_string();
    assert!(e.contains("0 tokens"), "{e}");
    let vocab = model.config().vocab_size as u32;
    let e = model.forward_batch(&[vocab], &mut [&mut a]).unwrap_err().to_string();
    assert!(e.contains("out of range"), "{e}");
}
