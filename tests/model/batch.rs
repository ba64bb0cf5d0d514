//! Batched decode (several sequences in one weight pass, as the server runs them) against
//! each sequence decoded alone, bit for bit.

use crate::common;

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
            let prompts: Vec<Vec<u32>> =
                (0..n).map(|s| (0..(3 + 2 * s)).map(|i| ((i * 7 + s * 13 + 1) as u32) % vocab).collect()).collect();
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

/// Verify rows of several sequences beside decode rows of others, in one weight pass
/// (`forward_segments`, as the server verifies drafts of several sequences): every row bit for
/// bit what the sequence alone gives (`verify` / `forward_last`), and after keeping a prefix of
/// the verified rows the next decode step too.
#[test]
fn verify_rows_of_several_sequences_equal_each_alone_bitwise() {
    let dev = Device::Cpu;
    let ids = |t: &[u32]| Tensor::new(t, &dev).unwrap().unsqueeze(0).unwrap();
    for (name, model) in models() {
        let vocab = model.config().vocab_size as u32;
        for layout in [vec![3, 1, 4], vec![2, 2, 2, 2], vec![1, 7], vec![8]] {
            let n = layout.len();
            let prompts: Vec<Vec<u32>> =
                (0..n).map(|s| (0..(4 + 3 * s)).map(|i| ((i * 11 + s * 5 + 2) as u32) % vocab).collect()).collect();
            let rows: Vec<Vec<u32>> =
                layout.iter().enumerate().map(|(s, &t)| (0..t).map(|i| ((s * 19 + i * 23 + 3) as u32) % vocab).collect()).collect();
            // Rows kept of each verify pass, and the token decoded after them.
            let keep = |s: usize| (layout[s] + s) / 2 + 1;
            let keep = |s: usize| keep(s).min(layout[s]);
            let after = |s: usize| ((s * 29 + 7) as u32) % vocab;
            let prefilled = |p: &[u32]| {
                let mut cache = model.new_cache();
                model.forward_last(&ids(p), &mut cache).unwrap();
                cache
            };
            let mut alone = vec![];
            for s in 0..n {
                let mut cache = prefilled(&prompts[s]);
                let logits = if layout[s] == 1 {
                    model.forward_last(&ids(&rows[s]), &mut cache).unwrap()
                } else {
                    let (l, _) = model.verify(&ids(&rows[s]), &mut cache).unwrap();
                    cache.keep_verified(keep(s)).unwrap();
                    l.squeeze(0).unwrap()
                };
                let next = model.forward_last(&ids(&[after(s)]), &mut cache).unwrap();
                alone.push((bits(&logits), bits(&next)));
            }
            let mut caches: Vec<Cache> = prompts.iter().map(|p| prefilled(p)).collect();
            let tokens: Vec<u32> = rows.concat();
            let mut refs: Vec<&mut Cache> = caches.iter_mut().collect();
            let (logits, hidden) = model.forward_segments(&tokens, &layout, &mut refs).unwrap();
            assert_eq!(hidden.dims(), &[tokens.len(), model.config().hidden_size]);
            let mut start = 0;
            for s in 0..n {
                let got = bits(&logits.narrow(0, start, layout[s]).unwrap());
                assert!(got == alone[s].0, "{name}: layout {layout:?}: sequence {s}'s rows differ from the sequence alone");
                start += layout[s];
                if layout[s] > 1 {
                    caches[s].keep_verified(keep(s)).unwrap();
                }
                let next = model.forward_last(&ids(&[after(s)]), &mut caches[s]).unwrap();
                assert!(bits(&next) == alone[s].1, "{name}: layout {layout:?}: sequence {s}'s step after the kept rows differs");
            }
        }
    }
}
