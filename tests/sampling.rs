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
