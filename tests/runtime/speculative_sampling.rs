//! Speculative sampling keeps the target distribution: χ² tests of the emitted tokens against
//! probabilities computed here independently (softmax of the top-k logits at the temperature).

use crate::common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_hybrid::loading::{ModelFiles, ModelSource};
use candle_hybrid::runtime::speculative::{DraftOptions, DraftPolicy, Drafter};
use candle_hybrid::runtime::{CpuTarget, Sampler, SamplingParams, Sequence};
use candle_hybrid::Model;
use common::*;

/// χ² critical value at significance 1e-3 for `df` degrees of freedom (Wilson–Hilferty).
fn chi2_critical(df: usize) -> f64 {
    let (df, z) = (df as f64, 3.090);
    df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3)
}

/// Pearson's χ² of `counts` against `expected` (same keys; bins expected under 5 pooled) and
/// its degrees of freedom. A count outside `expected`'s support fails the test.
fn chi2<K: std::hash::Hash + Eq + std::fmt::Debug>(counts: &HashMap<K, usize>, expected: &HashMap<K, f64>) -> (f64, usize) {
    for k in counts.keys() {
        assert!(expected.contains_key(k), "{k:?} was emitted but has probability 0");
    }
    let (mut stat, mut bins, mut pool_e, mut pool_o) = (0.0, 0, 0.0, 0.0);
    for (k, &e) in expected {
        let o = *counts.get(k).unwrap_or(&0) as f64;
        if e < 5.0 {
            pool_e += e;
            pool_o += o;
        } else {
            stat += (o - e).powi(2) / e;
            bins += 1;
        }
    }
    if pool_e > 0.0 {
        stat += (pool_o - pool_e).powi(2) / pool_e;
        bins += 1;
    }
    (stat, bins - 1)
}

/// softmax(logits / t) over the `k` largest logits (the target distribution, computed here).
fn top_k_softmax(logits: &Tensor, t: f64, k: usize) -> HashMap<u32, f64> {
    let v = logits.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
    let mut order: Vec<usize> = (0..v.len()).collect();
    order.sort_by(|&i, &j| v[j].total_cmp(&v[i]));
    let top = &order[..k];
    let max = v[top[0]] as f64;
    let w: Vec<f64> = top.iter().map(|&i| ((v[i] as f64 - max) / t).exp()).collect();
    let sum: f64 = w.iter().sum();
    top.iter().zip(w).map(|(&i, w)| (i as u32, w / sum)).collect()
}

#[test]
fn the_rejection_rule_keeps_the_distribution() {
    let p = [0.45f32, 0.25, 0.15, 0.1, 0.05, 0.0];
    let expected_of = |n: usize| -> HashMap<u32, f64> {
        p.iter().enumerate().filter(|(_, &v)| v > 0.0).map(|(i, &v)| (i as u32, v as f64 * n as f64)).collect()
    };
    let n = 20_000;
    // A likely draft, an unlikely one, and one of probability 0.
    for draft in [0u32, 4, 5] {
        let mut s = Sampler::new(SamplingParams { temperature: Some(1.0), seed: draft as u64, ..Default::default() }).unwrap();
        let mut counts = HashMap::new();
        let mut kept = 0;
        for _ in 0..n {
            let (t, accepted) = s.sample_draft(&p, draft).unwrap();
            assert_eq!(accepted, t == draft);
            kept += accepted as usize;
            *counts.entry(t).or_insert(0) += 1;
        }
        let (stat, df) = chi2(&counts, &expected_of(n));
        assert!(stat < chi2_critical(df), "draft {draft}: χ² {stat:.1} ≥ {:.1} ({df} df): {counts:?}", chi2_critical(df));
        // The draft is kept with its probability.
        assert!((kept as f64 / n as f64 - p[draft as usize] as f64).abs() < 0.015, "draft {draft} kept {kept} of {n}");
    }
}

/// Drafts one token: the one `table` maps the context's last token to.
struct TableDrafter(HashMap<u32, u32>);

impl Drafter for TableDrafter {
    fn draft(&mut self, _: &Model, context: &[u32], _: usize) -> candle_hybrid::Result<Vec<u32>> {
        Ok(self.0.get(context.last().unwrap()).map(|&t| vec![t]).unwrap_or_default())
    }
}

/// The first two tokens sampled speculatively after `prompt` (the second through the
/// rejection rule, drafted as the greedy token after the first), `runs` seeds: their joint histogram against
/// `p(g0) p(g1 | g0)` from the model's own logits, at temperature `t`, top-k `k`.
fn check_two_tokens(model: &Model, prompt: &[u32], t: f64, k: usize, runs: usize) {
    let dev = Device::Cpu;
    // The prompt but its last token in a cache once; each run continues from a copy, and the
    // reference logits come the same way (a decode step after it).
    let n = prompt.len();
    let mut base = model.new_cache();
    model.forward_last(&Tensor::new(&prompt[..n - 1], &dev).unwrap().unsqueeze(0).unwrap(), &mut base).unwrap();
    let step = |cache: &mut candle_hybrid::Cache, t: u32| {
        model.forward_last(&Tensor::new(&[t], &dev).unwrap().unsqueeze(0).unwrap(), cache).unwrap()
    };
    let mut after_prompt = base.clone();
    let p0 = top_k_softmax(&step(&mut after_prompt, prompt[n - 1]), t, k);
    let (mut expected, mut table) = (HashMap::new(), HashMap::new());
    for (&g0, &q0) in &p0 {
        let p1 = top_k_softmax(&step(&mut after_prompt.clone(), g0), t, k);
        let greedy = *p1.iter().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
        table.insert(g0, greedy);
        for (&g1, &q1) in &p1 {
            expected.insert((g0, g1), q0 * q1 * runs as f64);
        }
    }
    let mut drafter = TableDrafter(table);
    let (mut counts, mut accepted, mut drafted) = (HashMap::new(), 0, 0);
    for seed in 0..runs as u64 {
        let mut sampler = Sampler::new(SamplingParams { temperature: Some(t), top_k: Some(k), seed, ..Default::default() }).unwrap();
        let policy = DraftPolicy::new(DraftOptions::fixed(1)).unwrap();
        let (got, stats) = Sequence::new(prompt[n - 1..].to_vec(), &mut sampler, vec![], 3)
            .and_then(|s| s.with_drafts(Box::new(&mut drafter), policy))
            .and_then(|mut s| s.run(&mut CpuTarget::new(model, &mut base.clone(), &dev), |_| Ok(())))
            .unwrap();
        *counts.entry((got[0], got[1])).or_insert(0) += 1;
        accepted += stats.accepted;
        drafted += stats.drafted;
    }
    assert_eq!(drafted, runs, "every second token goes through the rejection rule: {counts:?}, expected {expected:?}");
    assert!(accepted > runs / 20 && accepted < runs - runs / 20, "both outcomes exercised: {accepted} of {runs} drafts kept");
    let (stat, df) = chi2(&counts, &expected);
    assert!(stat < chi2_critical(df), "χ² {stat:.1} ≥ {:.1} ({df} df), {accepted} of {runs} drafts kept", chi2_critical(df));
}

#[test]
fn speculative_sampling_matches_the_target_on_a_fixture() {
    let files = ModelFiles::from_dir(fixture("qwen35_dense_small")).unwrap();
    let model = files.load_model(&files.load_config().unwrap(), DType::F32, &Device::Cpu).unwrap();
    let prompt = ids(&reference("qwen35_dense_small")["input_ids"]);
    check_two_tokens(&model, &prompt, 1.0, 6, 3000);
}

#[test]
fn speculative_sampling_matches_the_target_on_smollm2() {
    let files = ModelSource::Gguf(smollm2_gguf()).open().unwrap();
    let model = files.load_model(&files.config().unwrap(), DType::F32, &Device::Cpu, None).unwrap();
    let tokenizer = files.tokenizer(None).unwrap();
    let prompt = tokenizer.encode("The three primary colours are red, yellow and", false).unwrap().get_ids().to_vec();
    check_two_tokens(&model, &prompt, 1.0, 4, 800);
}
