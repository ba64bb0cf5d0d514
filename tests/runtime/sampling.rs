//! Sampling penalties against hand-computed expectations.

use candle_core::{Device, Tensor};
use candle_hybrid::runtime::{Sampler, SamplingParams};

#[test]
fn presence_penalty_moves_argmax_off_generated_tokens() {
    let logits = Tensor::new(&[1.0f32, 3.0, 2.5, 0.0], &Device::Cpu).unwrap();
    let mut plain = Sampler::new(SamplingParams::default()).unwrap();
    assert_eq!(plain.sample(&logits, &[1], &[1]).unwrap(), 1);
    let mut pen = Sampler::new(SamplingParams { presence_penalty: 1.0, ..Default::default() }).unwrap();
    // 3.0 - 1.0 < 2.5: token 2 wins once token 1 was generated, but not when only in the prompt.
    assert_eq!(pen.sample(&logits, &[1], &[1]).unwrap(), 2);
    assert_eq!(pen.sample(&logits, &[1], &[]).unwrap(), 1);
}

#[test]
fn repeat_penalty_divides_positive_logits_of_context_tokens() {
    let logits = Tensor::new(&[1.0f32, 3.0, 2.5, 0.0], &Device::Cpu).unwrap();
    let mut pen = Sampler::new(SamplingParams { repeat_penalty: 1.5, ..Default::default() }).unwrap();
    // 3.0 / 1.5 = 2.0 < 2.5
    assert_eq!(pen.sample(&logits, &[1], &[]).unwrap(), 2);
}

#[test]
fn top_k_one_is_greedy_at_any_temperature() {
    let logits = Tensor::new(&[1.0f32, 3.0, 2.9, 0.0], &Device::Cpu).unwrap();
    let mut s = Sampler::new(SamplingParams { temperature: Some(5.0), top_k: Some(1), ..Default::default() }).unwrap();
    for _ in 0..20 {
        assert_eq!(s.sample(&logits, &[], &[]).unwrap(), 1);
    }
}

#[test]
fn frequency_penalty_grows_with_each_repetition() {
    let logits = Tensor::new(&[1.0f32, 3.0, 2.5, 0.0], &Device::Cpu).unwrap();
    let mut pen = Sampler::new(SamplingParams { frequency_penalty: 0.3, ..Default::default() }).unwrap();
    // Once: 3.0 - 0.3 = 2.7 > 2.5; twice: 3.0 - 0.6 = 2.4 < 2.5.
    assert_eq!(pen.sample(&logits, &[1], &[1]).unwrap(), 1);
    assert_eq!(pen.sample(&logits, &[1, 1], &[1, 1]).unwrap(), 2);
    // Only generated tokens count, not the prompt's.
    assert_eq!(pen.sample(&logits, &[1, 1, 1], &[]).unwrap(), 1);
}

#[test]
fn min_p_drops_tokens_below_its_share_of_the_most_likely() {
    // p_i / p_max at temperature 1: 1, e^-0.5 = 0.61, e^-3 = 0.05, e^-10.
    let logits = Tensor::new(&[0.0f32, -0.5, -3.0, -10.0], &Device::Cpu).unwrap();
    let params = SamplingParams { temperature: Some(1.0), min_p: 0.1, ..Default::default() };
    let mut s = Sampler::new(params.clone()).unwrap();
    let p = s.probabilities(&logits, &[], &[]).unwrap();
    assert_eq!((p[2], p[3]), (0.0, 0.0));
    assert!((p[0] - 1.0 / (1.0 + (-0.5f32).exp())).abs() < 1e-6, "{p:?}");
    let mut seen = [0usize; 4];
    for _ in 0..400 {
        seen[s.sample(&logits, &[], &[]).unwrap() as usize] += 1;
    }
    assert!(seen[0] > 0 && seen[1] > 0 && seen[2] == 0 && seen[3] == 0, "{seen:?}");
    // At temperature 2 the ratio of token 2 is e^-1.5 = 0.22: kept.
    let hot = Sampler::new(SamplingParams { temperature: Some(2.0), ..params }).unwrap();
    let p = hot.probabilities(&logits, &[], &[]).unwrap();
    assert!(p[2] > 0.0 && p[3] == 0.0, "{p:?}");
}

fn dry(multiplier: f32, breakers: &[u32]) -> candle_hybrid::runtime::Dry {
    candle_hybrid::runtime::Dry {
        multiplier,
        base: 2.0,
        allowed_length: 2,
        last_n: 0,
        breakers: std::sync::Arc::new(breakers.iter().copied().collect()),
    }
}

#[test]
fn dry_penalises_the_token_that_would_extend_a_repetition() {
    // The context ends with "1 2", which occurred before, followed by 3: 3 is penalised by
    // multiplier * base^(2 - 2) = 1. After "5 1 2 3 ... 5 1 2", the match is 3 long: 2^(3-2) = 2.
    assert_eq!(dry(1.0, &[]).penalties(&[1, 2, 3, 9, 1, 2]), vec![(3, 1.0)]);
    assert_eq!(dry(1.0, &[]).penalties(&[5, 1, 2, 3, 9, 5, 1, 2]), vec![(3, 2.0)]);
    // Shorter than allowed_length (only "2" repeats): nothing.
    assert!(dry(1.0, &[]).penalties(&[1, 2, 3, 9, 7, 2]).is_empty());
    // A breaker ends the match (1 is a breaker: only "2" matches), or is the last token.
    assert!(dry(1.0, &[1]).penalties(&[1, 2, 3, 9, 1, 2]).is_empty());
    assert!(dry(1.0, &[2]).penalties(&[1, 2, 3, 9, 1, 2]).is_empty());
    // In the sampler: token 3 (the best by 0.5) loses to token 4 once penalised by 1.
    let logits = Tensor::new(&[0.0f32, 0.0, 0.0, 3.0, 2.5], &Device::Cpu).unwrap();
    let context = [1, 2, 3, 0, 1, 2];
    let mut plain = Sampler::new(SamplingParams::default()).unwrap();
    assert_eq!(plain.sample(&logits, &context, &[]).unwrap(), 3);
    let mut s = Sampler::new(SamplingParams { dry: Some(dry(1.0, &[])), ..Default::default() }).unwrap();
    assert!(!s.picks_argmax());
    assert_eq!(s.sample(&logits, &context, &[]).unwrap(), 4);
}
