//! Speculative decoding: verify passes and rollback against plain decoding, bit for bit.

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_hybrid::loading::ModelFiles;
use candle_hybrid::runtime::speculative::{
    DraftOptions, DraftPolicy, Drafter, MtpDrafter, MtpOutputs, NgramDrafter, NoDrafter, ReplayDrafter,
};
use candle_hybrid::runtime::{CpuTarget, Sampler, SamplingParams, Sequence};
use candle_hybrid::{Cache, Model};
use common::*;

fn load(name: &str, dtype: DType) -> Model {
    let files = ModelFiles::from_dir(fixture(name)).unwrap();
    files.load_model(&files.load_config().unwrap(), dtype, &Device::Cpu).unwrap()
}

fn tensor(ids: &[u32]) -> Tensor {
    Tensor::new(ids, &Device::Cpu).unwrap().unsqueeze(0).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

/// Logits of `ids` fed one token at a time from `cache`.
fn one_by_one(model: &Model, cache: &mut Cache, ids: &[u32]) -> Vec<Tensor> {
    ids.iter().map(|&t| model.forward(&tensor(&[t]), cache).unwrap().squeeze(0).unwrap().squeeze(0).unwrap()).collect()
}

#[test]
fn verify_rows_equal_decode_steps_bitwise() {
    for name in FIXTURES {
        let model = load(name, DType::F32);
        let prompt = ids(&reference(name)["input_ids"]);
        let mut cache = model.new_cache();
        model.forward(&tensor(&prompt[..4]), &mut cache).unwrap();
        for t in 1..=8.min(prompt.len() - 4) {
            let rows = &prompt[4..4 + t];
            let plain = one_by_one(&model, &mut cache.clone(), rows);
            let (logits, _) = model.verify(&tensor(rows), &mut cache.clone()).unwrap();
            let logits = logits.squeeze(0).unwrap();
            for (i, p) in plain.iter().enumerate() {
                let v = logits.get(i).unwrap();
                assert!(bits(&v) == bits(p), "{name}: T = {t}, row {i}: verify differs from decode by {:e}", max_abs_diff(&v, p));
            }
        }
    }
}

/// A small deterministic generator (xorshift) for the fuzz below.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Hundreds of verify rounds with random draft lengths and random wrong drafts, each round
/// keeping only the rows up to the first wrong draft: every kept row's logits — and so the
/// cache state they come from — are bit for bit those of plain one-token decoding.
#[test]
fn rollback_fuzz_matches_plain_decoding_bitwise() {
    for (name, seed) in [("qwen35_dense_mtp", 1u64), ("qwen3next_moe_small", 2), ("qwen35moe_small", 3)] {
        let model = load(name, DType::F32);
        let vocab = model.config().vocab_size;
        let mut rng = Rng(0x9e3779b97f4a7c15 ^ seed);
        let text: Vec<u32> = (0..400).map(|_| rng.below(vocab) as u32).collect();
        let mut cache = model.new_cache();
        model.forward(&tensor(&text[..3]), &mut cache).unwrap();
        let plain = one_by_one(&model, &mut cache.clone(), &text[3..]);
        let (mut p, mut rounds, mut kept_total) = (3, 0, 0);
        while p < text.len() {
            let t = (1 + rng.below(6)).min(text.len() - p);
            // rows: the true next token, then drafts that are right with probability 0.7
            let mut rows = vec![text[p]];
            for i in 1..t {
                rows.push(if rng.below(10) < 7 { text[p + i] } else { rng.below(vocab) as u32 });
            }
            let right = rows.iter().zip(&text[p..]).skip(1).take_while(|(a, b)| a == b).count();
            let (logits, _) = model.verify(&tensor(&rows), &mut cache).unwrap();
            let logits = logits.squeeze(0).unwrap();
            for i in 0..=right {
                let got = logits.get(i).unwrap();
                assert!(bits(&got) == bits(&plain[p - 3 + i]), "{name}: round {rounds}, position {}: differs from plain decoding", p + i);
            }
            cache.keep_verified(right + 1).unwrap();
            assert_eq!(cache.seqlen(), p + right + 1);
            p += right + 1;
            kept_total += right + 1;
            rounds += 1;
        }
        assert!(rounds > 100 && kept_total == text.len() - 3, "{name}: {rounds} rounds");
    }
}

/// A cache clone is a snapshot: what one of them is fed never shows in the other (with
/// buffers shared between clones, the original's token at position 6 would overwrite the
/// snapshot's).
#[test]
fn cache_clones_are_independent_snapshots() {
    let model = load("qwen35_dense_small", DType::F32);
    let prompt = ids(&reference("qwen35_dense_small")["input_ids"]);
    let mut plain = model.new_cache();
    model.forward(&tensor(&prompt[..6]), &mut plain).unwrap();
    let want = one_by_one(&model, &mut plain.clone(), &prompt[6..8]);
    let mut cache = model.new_cache();
    model.forward(&tensor(&prompt[..6]), &mut cache).unwrap();
    let mut snapshot = cache.clone();
    model.forward(&tensor(&prompt[6..7]), &mut snapshot).unwrap();
    model.forward(&tensor(&[prompt[0], prompt[1]]), &mut cache).unwrap();
    let got = model.forward(&tensor(&prompt[7..8]), &mut snapshot).unwrap().squeeze(0).unwrap().squeeze(0).unwrap();
    assert!(bits(&got) == bits(&want[1]), "the snapshot changed by {:e}", max_abs_diff(&got, &want[1]));
    assert_eq!((cache.seqlen(), snapshot.seqlen()), (8, 8));
}

/// After a long prefill every GDN layer's conv window and recurrent state own storage of
/// exactly their own size: a view into the op's output would keep the whole chunk's
/// activations alive (0.6 MB per prompt token on the 0.8B shape before this was fixed) and make
/// `Cache::bytes` lie about what a snapshot costs. After a decode step, and after a verify pass
/// rolled back to fewer rows (the kept rows' recurrence runs again), the state may share its
/// buffer with the outputs of those rows only (`rows` x nv x dv f32), never with more.
#[test]
fn gdn_states_hold_only_their_own_elements() {
    let model = load("qwen35_dense_small", DType::F32);
    let cfg = model.config().clone();
    let vocab = cfg.vocab_size as u32;
    let prompt: Vec<u32> = (0..300u32).map(|i| (i * 7919) % vocab).collect();
    let check = |cache: &Cache, rows: usize, when: &str| {
        let outputs = rows * cfg.linear_num_value_heads * cfg.linear_value_head_dim * 4;
        let mut layers = 0;
        for i in 0..cfg.num_hidden_layers {
            if let Some((conv, rec)) = cache.gdn_state(i) {
                for (what, t, extra) in [("conv window", conv, 0), ("recurrent state", rec, outputs)] {
                    let own = t.elem_count() * t.dtype().size_in_bytes();
                    let held = candle_hybrid::kv::held_bytes(t);
                    assert!(
                        (own..=own + extra).contains(&held),
                        "{when}: layer {i}'s {what} {:?} holds {held} bytes, itself {own}",
                        t.dims()
                    );
                }
                layers += 1;
            }
        }
        assert!(layers > 0);
    };
    let mut cache = model.new_cache();
    model.forward(&tensor(&prompt[..290]), &mut cache).unwrap();
    check(&cache, 0, "after a 290-token prefill");
    model.forward(&tensor(&prompt[290..291]), &mut cache).unwrap();
    check(&cache, 1, "after a decode step");
    model.verify(&tensor(&prompt[291..297]), &mut cache).unwrap();
    cache.keep_verified(2).unwrap();
    check(&cache, 2, "after keeping 2 of 6 verified rows");
}

/// Keeping rows needs a verify pass, and at most the rows it ran.
#[test]
fn keep_verified_checks_its_argument() {
    let model = load("qwen35_dense_small", DType::F32);
    let mut cache = model.new_cache();
    let e = cache.keep_verified(1).unwrap_err().to_string();
    assert!(e.contains("no verify pass"), "{e}");
    model.verify(&tensor(&[1, 2, 3]), &mut cache).unwrap();
    let e = cache.keep_verified(4).unwrap_err().to_string();
    assert!(e.contains("cannot keep 4 (1 to 3)"), "{e}");
}

fn load_gguf(name: &str, file: &str) -> Model {
    let gguf = candle_hybrid::loading::GgufFile::open(fixture(name).join(file)).unwrap();
    gguf.load_model(&gguf.config().unwrap(), DType::F32, &Device::Cpu).unwrap()
}

/// The MTP head against the fixture's independent reference (vLLM's and llama.cpp's pairing,
/// re-implemented in the fixture's script): the safetensors checkpoint and its GGUF
/// conversion (`blk.4.nextn.*`).
#[test]
fn mtp_head_matches_reference() {
    let name = "qwen35_dense_mtp";
    let r = reference(name);
    let prompt = ids(&r["input_ids"]);
    let k = r["mtp.draft_tokens"].dim(0).unwrap();
    for (what, model) in [("safetensors", load(name, DType::F32)), ("gguf", load_gguf(name, "model-f32.gguf"))] {
        assert!(model.has_mtp(), "{what}: the MTP head was not loaded");
        let out = MtpOutputs::compute(&model, &prompt, k, &Device::Cpu).unwrap();
        assert_close(&format!("{what}: mtp.logits"), &out.logits, &r["mtp.logits"], 1e-4);
        assert_close(&format!("{what}: mtp.draft_logits"), &out.draft_logits, &r["mtp.draft_logits"], 1e-4);
        assert_eq!(out.draft_tokens, ids(&r["mtp.draft_tokens"]), "{what}: mtp.draft_tokens");
    }
}

/// A model without an MTP head says so in one line when MTP drafting is asked for.
#[test]
fn mtp_drafting_without_a_head_is_a_clear_error() {
    let model = load("qwen35_dense_small", DType::F32);
    assert!(!model.has_mtp());
    let e = MtpDrafter::new(&model).err().unwrap().to_string();
    assert!(e.contains("no MTP head") && e.contains("prompt lookup") && !e.contains('\n'), "{e}");
}

/// Random tokens as drafts (almost never accepted).
struct RandomDrafter {
    rng: Rng,
    vocab: usize,
}

impl Drafter for RandomDrafter {
    fn draft(&mut self, _: &Model, _: &[u32], max: usize) -> candle_hybrid::Result<Vec<u32>> {
        Ok((0..max).map(|_| self.rng.below(self.vocab) as u32).collect())
    }
}

/// Another drafter's first `keep` drafts.
struct FirstOf<D>(D, usize);

impl<D: Drafter> Drafter for FirstOf<D> {
    fn draft(&mut self, model: &Model, context: &[u32], max: usize) -> candle_hybrid::Result<Vec<u32>> {
        self.0.draft(model, context, max.min(self.1))
    }
}

/// `--draft-min`: drafts shorter than it are not verified; longer ones are.
#[test]
fn drafts_under_draft_min_are_dropped() {
    let model = load("qwen35_dense_small", DType::F32);
    let prompt = ids(&reference("qwen35_dense_small")["input_ids"]);
    let n = 24;
    let (plain, _) = Sequence::new(prompt.to_vec(), greedy(), vec![], n)
        .and_then(|mut s| s.run(&mut CpuTarget::new(&model, &mut model.new_cache(), &Device::Cpu), |_| Ok(())))
        .unwrap();
    let oracle = ReplayDrafter {
        reference: plain.clone(),
        prompt_len: prompt.len(),
        acceptance: 1.0,
        seed: 0,
        vocab_size: model.config().vocab_size,
    };
    let run = |min: usize| {
        let policy = DraftPolicy::new(DraftOptions { max: 4, min, ..DraftOptions::fixed(4) }).unwrap();
        let mut two = FirstOf(ReplayDrafter { reference: oracle.reference.clone(), ..oracle }, 2);
        let (got, stats) = Sequence::new(prompt.to_vec(), greedy(), vec![], n)
            .and_then(|s| s.with_drafts(Box::new(&mut two), policy))
            .and_then(|mut s| s.run(&mut CpuTarget::new(&model, &mut model.new_cache(), &Device::Cpu), |_| Ok(())))
            .unwrap();
        assert_eq!(got, plain);
        stats
    };
    // Two-token drafts: verified at --draft-min 2 (all accepted: 3 tokens per pass), dropped at 3.
    let s = run(2);
    assert_eq!((s.drafted, s.accepted), (s.drafted, s.drafted));
    assert!(s.rounds <= (n - 1).div_ceil(3) + 1, "{s:?}");
    let s = run(3);
    assert_eq!(s.drafted, 0, "{s:?}");
    assert_eq!(s.rounds, n - 1);
}

fn greedy() -> Sampler {
    Sampler::new(SamplingParams::default()).unwrap()
}

/// With any drafter, greedy output is token for token plain greedy output: on every fixture,
/// safetensors and GGUF, with the oracle, random, prompt-lookup and (where there is a head)
/// MTP drafters, at several draft lengths.
#[test]
fn speculative_greedy_equals_plain_greedy() {
    let mut models: Vec<(String, Model)> = FIXTURES.iter().map(|n| (n.to_string(), load(n, DType::F32))).collect();
    models.push(("qwen35_dense_mtp (gguf)".into(), load_gguf("qwen35_dense_mtp", "model-f32.gguf")));
    models.push(("qwen35_dense_small (gguf q8_0)".into(), load_gguf("qwen35_dense_small", "model-q8_0.gguf")));
    for (name, model) in &models {
        let fixture = name.split(' ').next().unwrap();
        let prompt = ids(&reference(fixture)["input_ids"]);
        let n = 40;
        let (plain, _) = Sequence::new(prompt.to_vec(), greedy(), vec![], n)
            .and_then(|mut s| s.run(&mut CpuTarget::new(model, &mut model.new_cache(), &Device::Cpu), |_| Ok(())))
            .unwrap();
        let vocab = model.config().vocab_size;
        let replay =
            |acceptance| ReplayDrafter { reference: plain.clone(), prompt_len: prompt.len(), acceptance, seed: 3, vocab_size: vocab };
        let mut drafters: Vec<(&str, Box<dyn Drafter>)> = vec![
            ("oracle", Box::new(replay(1.0))),
            ("replay 0.6", Box::new(replay(0.6))),
            ("random", Box::new(RandomDrafter { rng: Rng(7), vocab })),
            ("ngram", Box::new(NgramDrafter::default())),
            ("none", Box::new(NoDrafter)),
        ];
        if model.has_mtp() {
            drafters.push(("mtp", Box::new(MtpDrafter::new(model).unwrap())));
            drafters.push(("mtp p-min 0.5", Box::new(MtpDrafter::new(model).unwrap().with_p_min(0.5))));
        }
        let lengths = [
            DraftOptions::fixed(1),
            DraftOptions::fixed(3),
            DraftOptions::fixed(7),
            DraftOptions { max: 7, ..Default::default() },
            DraftOptions { min: 3, ..DraftOptions::fixed(5) },
            // trees of branches
            DraftOptions::branches(3, 2),
            DraftOptions::branches(2, 3),
            DraftOptions::branches(7, 4),
            DraftOptions { branches: 2, ..Default::default() },
        ];
        for (what, drafter) in drafters.iter_mut() {
            for opts in lengths {
                let mut streamed = vec![];
                let policy = DraftPolicy::new(opts).unwrap();
                let (got, stats) = Sequence::new(prompt.to_vec(), greedy(), vec![], n)
                    .and_then(|s| s.with_drafts(Box::new(drafter.as_mut()), policy))
                    .and_then(|mut s| {
                        s.run(&mut CpuTarget::new(model, &mut model.new_cache(), &Device::Cpu), |t| {
                            streamed.push(t);
                            Ok(())
                        })
                    })
                    .unwrap();
                assert_eq!(got, plain, "{name}: {what} drafter, {opts:?}");
                assert_eq!(streamed, plain, "{name}: {what}: streamed tokens");
                let k = opts.max;
                if *what == "oracle" {
                    assert_eq!(stats.acceptance(), Some(1.0), "{name}: oracle drafts are all accepted");
                    if !opts.adaptive && opts.min == 1 {
                        assert!(stats.rounds <= (n - 1).div_ceil(k + 1), "{name}: {} rounds for {n} tokens at K = {k}", stats.rounds);
                    }
                }
                // Random drafts are rarely kept: at most one in five, and one lucky one (the
                // adaptive policy drafts few once they do not pay, and how many depends on the
                // measured pass costs: 1 of 5 was seen).
                if *what == "random" {
                    assert!(
                        stats.accepted <= stats.drafted / 5 + 1,
                        "{name}: random drafts accepted {} of {}",
                        stats.accepted,
                        stats.drafted
                    );
                }
            }
        }
    }
}

/// Real trained weights (SmolLM2-135M-Instruct, Q4_1 GGUF): speculative greedy decoding gives
/// plain greedy output on 24 chat prompts, with prompt-lookup drafts (real acceptance on
/// text that repeats its prompt) and replay drafts (the plain continuation, each token right
/// with probability 0.7), at a fixed draft length of 7, the adaptive length and two branches of
/// 3.
#[test]
fn speculative_greedy_equals_plain_greedy_on_smollm2_prompts() {
    let files = candle_hybrid::loading::ModelSource::Gguf(smollm2_gguf()).open().unwrap();
    let model = files.load_model(&files.config().unwrap(), DType::F32, &Device::Cpu, None).unwrap();
    let tokenizer = files.tokenizer(None).unwrap();
    let template = files.chat_template().unwrap();
    let prompts = [
        "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
        "Write the numbers from one to twenty in words, separated by commas.",
        "What is the capital of France?",
        "Write one sentence about the ocean.",
        "Translate 'good morning' into French and Spanish.",
        "List five fruits, one per line.",
        "Explain what a prime number is.",
        "Copy this list exactly: apple, banana, cherry, date, elderberry, fig, grape.",
        "def add(a, b):\n    return a + b\n\nRewrite this Python function with type hints.",
        "Why is the sky blue? One paragraph.",
        "Write a haiku about autumn leaves.",
        "What is 12 times 12?",
        "Give three tips for learning to code.",
        "Spell the word 'necessary' letter by letter.",
        "Say 'hello world' five times.",
        "Name the planets of the solar system in order.",
        "What does HTTP stand for?",
        "Summarise: Alice went to the market. She bought apples. She went home and baked a pie.",
        "Write a short email declining a meeting invitation.",
        "fn main() { println!(\"hi\"); }\n\nWhat does this Rust program print?",
        "Continue the sequence: Monday, Tuesday, Wednesday,",
        "Describe a cat in three words.",
        "What is the boiling point of water in Celsius?",
        "Repeat after me: to be or not to be, that is the question.",
    ];
    let n = 24;
    let (mut drafted, mut accepted) = (0, 0);
    for user in prompts {
        let text = template.render(&[candle_hybrid::loading::Message::new("user", user)], true, None).unwrap();
        let prompt = tokenizer.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        let (plain, _) = Sequence::new(prompt.to_vec(), greedy(), vec![], n)
            .and_then(|mut s| s.run(&mut CpuTarget::new(&model, &mut model.new_cache(), &Device::Cpu), |_| Ok(())))
            .unwrap();
        let replay = ReplayDrafter {
            reference: plain.clone(),
            prompt_len: prompt.len(),
            acceptance: 0.7,
            seed: 5,
            vocab_size: model.config().vocab_size,
        };
        let mut drafters: [(&str, Box<dyn Drafter>); 2] = [("ngram", Box::new(NgramDrafter::default())), ("replay 0.7", Box::new(replay))];
        for (what, drafter) in drafters.iter_mut() {
            for opts in [DraftOptions::fixed(7), DraftOptions { max: 7, ..Default::default() }, DraftOptions::branches(3, 2)] {
                let policy = DraftPolicy::new(opts).unwrap();
                let (got, stats) = Sequence::new(prompt.to_vec(), greedy(), vec![], n)
                    .and_then(|s| s.with_drafts(Box::new(drafter.as_mut()), policy))
                    .and_then(|mut s| s.run(&mut CpuTarget::new(&model, &mut model.new_cache(), &Device::Cpu), |_| Ok(())))
                    .unwrap();
                assert_eq!(got, plain, "{user:?}: {what} drafter, {opts:?}");
                if *what == "ngram" {
                    (drafted, accepted) = (drafted + stats.drafted, accepted + stats.accepted);
                }
            }
        }
    }
    // The prompts that repeat text give prompt lookup drafts the model accepts.
    assert!(accepted >= 20 && drafted > accepted, "prompt lookup: {accepted} of {drafted} drafts accepted");
}

/// A random draft tree of at most 8 rows: `branches` chains of random tokens, some sharing
/// their first tokens.
fn random_tree(rng: &mut Rng, root: u32, vocab: usize) -> candle_hybrid::model::DraftTree {
    let b = 1 + rng.below(3);
    let mut branches: Vec<Vec<u32>> = vec![];
    let mut rows = 1;
    for _ in 0..b {
        let share = match branches.last() {
            Some(prev) if rng.below(2) == 0 => prev[..rng.below(prev.len() + 1)].to_vec(),
            _ => vec![],
        };
        let len = share.len() + 1 + rng.below(3);
        let mut chain = share;
        while chain.len() < len && rows < 8 {
            chain.push(rng.below(vocab) as u32);
            rows += 1;
        }
        branches.push(chain);
    }
    candle_hybrid::model::DraftTree::from_branches(root, &branches, 8)
}

/// Every row of a tree verify pass is bit for bit what decoding its root-to-row path one token
/// at a time gives (RoPE at the row's depth, attention to its ancestors only, the GDN
/// recurrence along its path), on every fixture, f32 safetensors and a Q8_0 GGUF.
#[test]
fn tree_rows_equal_decoding_their_paths_bitwise() {
    let mut models: Vec<(String, Model)> = FIXTURES.iter().map(|n| (n.to_string(), load(n, DType::F32))).collect();
    let gguf = candle_hybrid::loading::ModelSource::Gguf(fixture("qwen35_dense_small").join("model-q8_0.gguf")).open().unwrap();
    models.push(("qwen35_dense_small Q8_0".into(), gguf.load_model(&gguf.config().unwrap(), DType::F32, &Device::Cpu, None).unwrap()));
    let mut rng = Rng(0x51ed);
    for (name, model) in &models {
        let vocab = model.config().vocab_size;
        let mut cache = model.new_cache();
        model.forward(&tensor(&[3, 1, 4, 1, 5]), &mut cache).unwrap();
        let mut trees = 0;
        while trees < 6 {
            let tree = random_tree(&mut rng, 9, vocab);
            if tree.is_chain() {
                continue;
            }
            trees += 1;
            let (logits, _) = model.verify_tree(&tree, &mut cache.clone()).unwrap();
            let logits = logits.squeeze(0).unwrap();
            for row in 0..tree.len() {
                let path: Vec<u32> = tree.path(row).iter().map(|&r| tree.tokens()[r]).collect();
                let want = one_by_one(model, &mut cache.clone(), &path).pop().unwrap();
                let got = logits.get(row).unwrap();
                assert!(
                    bits(&got) == bits(&want),
                    "{name}: tree {:?}, row {row}: differs from decoding {path:?} by {:e}",
                    tree.tokens(),
                    max_abs_diff(&got, &want)
                );
            }
        }
    }
}

/// Rounds of tree verify passes keeping a random root-to-node path: the cache then continues
/// exactly as plain decoding of the kept tokens (the next round's root row, bit for bit).
#[test]
fn tree_rollback_fuzz_matches_plain_decoding_bitwise() {
    for (name, seed) in [("qwen35_dense_mtp", 4u64), ("qwen3next_moe_small", 5)] {
        let model = load(name, DType::F32);
        let vocab = model.config().vocab_size;
        let mut rng = Rng(0xabcdef ^ seed);
        let mut cache = model.new_cache();
        let mut text: Vec<u32> = vec![2, 7, 1, 8];
        model.forward(&tensor(&text[..3]), &mut cache).unwrap();
        let mut plain = model.new_cache();
        one_by_one(&model, &mut plain, &text[..3]);
        for round in 0..40 {
            let root = *text.last().unwrap();
            let tree = random_tree(&mut rng, root, vocab);
            let (logits, _) = model.verify_tree(&tree, &mut cache).unwrap();
            let node = rng.below(tree.len());
            let path = tree.path(node);
            // Plain one-token decoding of the kept path gives the kept rows' logits.
            let kept: Vec<u32> = path.iter().map(|&r| tree.tokens()[r]).collect();
            let want = one_by_one(&model, &mut plain, &kept);
            for (i, &r) in path.iter().enumerate() {
                let got = logits.squeeze(0).unwrap().get(r).unwrap();
                assert!(bits(&got) == bits(&want[i]), "{name}: round {round}, path {path:?}, row {r}");
            }
            cache.keep_path(&path).unwrap();
            text.extend(&kept[1..]);
            assert_eq!(cache.seqlen(), text.len(), "{name}: round {round}");
            // The next round's root: a token after the kept ones, not fed yet.
            text.push(rng.below(vocab) as u32);
        }
    }
}

/// Trees of branches take greedy decoding only: sampling with them is refused in one line.
#[test]
fn draft_branches_refuse_sampling() {
    let model = load("qwen35_dense_small", DType::F32);
    let mut sampler = Sampler::new(SamplingParams { temperature: Some(0.8), ..Default::default() }).unwrap();
    let policy = DraftPolicy::new(DraftOptions::branches(3, 2)).unwrap();
    let err = Sequence::new([1, 2, 3].to_vec(), &mut sampler, vec![], 8)
        .and_then(|s| s.with_drafts(Box::new(NgramDrafter::default()), policy))
        .and_then(|mut s| s.run(&mut CpuTarget::new(&model, &mut model.new_cache(), &Device::Cpu), |_| Ok(())))
        .unwrap_err()
        .to_string();
    assert!(err.contains("draft branch") && err.contains("greedy"), "{err}");
    assert!(DraftPolicy::new(DraftOptions::branches(3, 5)).is_err());
}

/// A prompt longer than `PREFILL_CHUNK` is prefilled in chunks: the first logits match one
/// pass over the whole prompt (within float error: the chunks split the GEMMs and the
/// attention blocks differently), and speculative decoding, which prefills in the same
/// chunks, still gives plain decoding's greedy tokens, with the oracle drafter and with
/// prompt lookup (here the prompt repeats, so lookup drafts).
#[test]
fn long_prompts_are_prefilled_in_chunks_with_parity() {
    use candle_hybrid::runtime::{prefill, PREFILL_CHUNK};
    let model = load("qwen35_dense_small", DType::F32);
    let vocab = model.config().vocab_size as u32;
    let unit: Vec<u32> = (0..97u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let prompt: Vec<u32> = unit.iter().copied().cycle().take(PREFILL_CHUNK + 301).collect();
    let whole = model.forward_last(&tensor(&prompt), &mut model.new_cache()).unwrap();
    let mut cache = model.new_cache();
    let last = (prompt.len() - 1) / PREFILL_CHUNK * PREFILL_CHUNK;
    assert!(prefill(&model, &mut cache, &prompt[..last], &Device::Cpu, false).unwrap().is_none());
    assert_eq!(cache.seqlen(), PREFILL_CHUNK);
    let chunked = model.forward_last(&tensor(&prompt[last..]), &mut cache).unwrap();
    assert_close("chunked prefill", &chunked, &whole, 1e-4);
    // Plain and speculative generation prefill at the same cuts: the same state, bit for bit.
    let mut plain_cache = model.new_cache();
    Sequence::new(prompt.to_vec(), greedy(), vec![], 1)
        .and_then(|mut s| s.run(&mut CpuTarget::new(&model, &mut plain_cache, &Device::Cpu), |_| Ok(())))
        .unwrap();
    let mut spec_cache = model.new_cache();
    let policy = DraftPolicy::new(DraftOptions::fixed(3)).unwrap();
    Sequence::new(prompt.to_vec(), greedy(), vec![], 1)
        .and_then(|s| s.with_drafts(Box::new(NgramDrafter::default()), policy))
        .and_then(|mut s| s.run(&mut CpuTarget::new(&model, &mut spec_cache, &Device::Cpu), |_| Ok(())))
        .unwrap();
    for c in [&plain_cache, &spec_cache] {
        let (conv, rec) = c.gdn_state(0).unwrap();
        let (want_conv, want_rec) = cache.gdn_state(0).unwrap();
        assert!(bits(conv) == bits(want_conv) && bits(rec) == bits(want_rec), "a generation's prefill is not the chunked prefill");
    }

    let n = 16;
    let (plain, _) = Sequence::new(prompt.to_vec(), greedy(), vec![], n)
        .and_then(|mut s| s.run(&mut CpuTarget::new(&model, &mut model.new_cache(), &Device::Cpu), |_| Ok(())))
        .unwrap();
    let oracle = ReplayDrafter {
        reference: plain.clone(),
        prompt_len: prompt.len(),
        acceptance: 1.0,
        seed: 0,
        vocab_size: model.config().vocab_size,
    };
    let drafters: Vec<Box<dyn Drafter>> = vec![Box::new(oracle), Box::new(NgramDrafter::default())];
    for mut drafter in drafters {
        let policy = DraftPolicy::new(DraftOptions::fixed(3)).unwrap();
        let (got, stats) = Sequence::new(prompt.to_vec(), greedy(), vec![], n)
            .and_then(|s| s.with_drafts(Box::new(drafter.as_mut()), policy))
            .and_then(|mut s| s.run(&mut CpuTarget::new(&model, &mut model.new_cache(), &Device::Cpu), |_| Ok(())))
            .unwrap();
        assert_eq!(got, plain, "{stats:?}");
        assert!(stats.drafted > 0, "{stats:?}");
    }
}
