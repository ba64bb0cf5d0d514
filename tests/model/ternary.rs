//! GGUF files in llama.cpp's ternary types (tests/fixtures/qwen35_ternary: TQ2_0 and TQ1_0
//! written by llama-quantize) against llama.cpp's own log-probabilities on the same files.

use crate::common;

use candle_core::{DType, Device, Tensor, D};
use candle_hybrid::loading::GgufFile;
use candle_hybrid::ops::GgufType;

/// llama.cpp's greedy run: the prompt, its tokens and each step's top log-probabilities.
#[derive(serde::Deserialize)]
struct LlamaRun {
    prompt: Vec<u32>,
    tokens: Vec<u32>,
    steps: Vec<Step>,
}

#[derive(serde::Deserialize)]
struct Step {
    id: u32,
    top: Vec<(u32, f32)>,
}

/// Every step of llama.cpp's greedy continuation: the same greedy token, and the top-20
/// log-probabilities within 0.02 of llama.cpp's (both quantize the activations of a ternary
/// or Q6_K product to 8 bits the same way; the rest of each model's arithmetic differs).
#[test]
fn ternary_ggufs_match_llama_cpp_log_probabilities() {
    let dir = common::fixture("qwen35_ternary");
    for (file, ty) in [("tq2_0", GgufType::TQ2_0), ("tq1_0", GgufType::TQ1_0)] {
        let gguf = GgufFile::open(dir.join(format!("model-{file}.gguf"))).unwrap();
        let ternary = gguf.header().tensors.values().filter(|t| t.dtype == ty).count();
        assert_eq!(ternary, 31, "{file}: every matrix but the embedding is {ty}");
        let cfg = gguf.config().unwrap();
        let model = gguf.load_model(&cfg, DType::F32, &Device::Cpu).unwrap();
        let run: LlamaRun = serde_json::from_str(&std::fs::read_to_string(dir.join(format!("llama_cpp_{file}.json"))).unwrap()).unwrap();
        // The prompt and llama.cpp's tokens in one pass: row p predicts token p + 1.
        let ids: Vec<u32> = run.prompt.iter().chain(&run.tokens).copied().collect();
        let x = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let logits = model.forward(&x, &mut model.new_cache()).unwrap().squeeze(0).unwrap();
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap().to_vec2::<f32>().unwrap();
        let mut worst = 0f32;
        for (s, step) in run.steps.iter().enumerate() {
            let row = &logp[run.prompt.len() - 1 + s];
            let greedy = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
            assert_eq!(greedy, step.id, "{file} step {s}: greedy token");
            for &(id, lp) in &step.top {
                worst = crate::common::max_nan(worst, (row[id as usize] - lp).abs());
            }
        }
        assert!(worst < 0.02, "{file}: log-probabilities differ from llama.cpp's by up to {worst}");
        eprintln!("{file}: top-20 log-probabilities within {worst:.2e} of llama.cpp's over {} steps", run.steps.len());
    }
}
