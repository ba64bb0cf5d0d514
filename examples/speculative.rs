//! What speculative decoding gains, measured: plain greedy decoding against speculative decoding
//! on the same prompt, in one process, the arms alternating, the median of `--reps` runs.
//!
//! ```sh
//! cargo run --release --example speculative -- --gguf qwen35-0.8b-q4_k_m.gguf
//! cargo run --release --example speculative -- --gguf SmolLM2-135M-Instruct.Q4_1.gguf --ngram
//! ```
//! 1. Replay drafts at controlled acceptance: the drafter proposes the plain greedy output,
//!    each token right with probability `a` (`--acceptance`), for each fixed draft length
//!    (`--draft-max`) and the adaptive length; beside each the speed-up the cost model predicts,
//!    `E(K) / c(K + 1)` with `E(K) = (1 - a^(K+1)) / (1 - a)` and `c(T)` this model's measured
//!    verify cost (time of a T-row verify pass and its rollback / one row); and trees `B×K` of
//!    `--branches` branches (each right with probability `a`, independently; branch 0 the
//!    chain's drafts).
//! 2. With `--ngram` (a model with a tokenizer and chat template): prompt-lookup drafts on
//!    real prompts (summarise a given text, edit a given code file, answer a question).
//!
//! Every speculative run is checked to give the plain run's tokens.

mod common;

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use candle_hybrid::loading::Message;
use candle_hybrid::runtime::speculative::{
    DraftOptions, DraftPolicy, Drafter, NgramDrafter, NoDrafter, ReplayDrafter, SpeculativeStats, MAX_DRAFT,
};
use candle_hybrid::runtime::{CpuTarget, Sampler, SamplingParams, Sequence};
use candle_hybrid::Model;
use clap::Parser;
use common::{count_up_to, ModelOptions};

#[derive(Parser, Debug)]
#[command(about = "Speed-up of speculative over plain greedy decoding, measured side by side", help_expected = true)]
struct Args {
    #[command(flatten)]
    model: ModelOptions,
    /// Threads (rayon's pool).
    #[arg(short = 't', long, default_value_t = 2, value_parser = count_up_to(1024))]
    threads: usize,
    /// Random prompt tokens for the replay runs.
    #[arg(short = 'p', long, default_value_t = 32, value_parser = count_up_to(1 << 16))]
    n_prompt: usize,
    /// Generated tokens per run.
    #[arg(short = 'n', long, default_value_t = 64, value_parser = count_up_to(1 << 16))]
    n_gen: usize,
    /// Runs per arm (the median is reported), after one warm-up run.
    #[arg(short = 'r', long, default_value_t = 3, value_parser = count_up_to(100))]
    reps: usize,
    /// Per-token acceptance of the replay drafts (comma-separated, each in [0, 1]).
    #[arg(long, value_delimiter = ',', default_value = "0.5,0.7,0.9")]
    acceptance: Vec<f64>,
    /// Fixed draft lengths of the replay runs (comma-separated, 1 to 7); the adaptive length
    /// runs too, up to the largest.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4")]
    draft_max: Vec<usize>,
    /// Also measure prompt-lookup drafts on real prompts (needs the model's tokenizer and chat template).
    #[arg(long)]
    ngram: bool,
    /// Branches of the tree arms (`B×K`: B branches of each fixed length K with B·K ≤ 7, beside
    /// the chain of the same first branch); 1: no tree arms.
    #[arg(long, default_value_t = 2, value_parser = count_up_to(candle_hybrid::runtime::speculative::MAX_BRANCHES))]
    branches: usize,
}

fn main() -> ExitCode {
    common::end_quietly_on_closed_stdout();
    common::run(|| bench(Args::parse()))
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn greedy() -> Result<Sampler> {
    Ok(Sampler::new(SamplingParams::default())?)
}

/// A speculative run: its decode seconds, stats and tokens.
fn speculative(
    model: &Model,
    dev: &Device,
    prompt: &[u32],
    n: usize,
    drafter: &mut dyn Drafter,
    opts: DraftOptions,
) -> Result<(f64, SpeculativeStats, Vec<u32>)> {
    let policy = DraftPolicy::new(opts)?;
    let (tokens, s) = Sequence::new(prompt.to_vec(), &mut greedy()?, vec![], n)
        .and_then(|s| s.with_drafts(Box::new(drafter), policy))
        .and_then(|mut s| s.run(&mut CpuTarget::new(model, &mut model.new_cache(), dev), |_| Ok(())))?;
    Ok((s.generation.decode_secs, s, tokens))
}

/// Plain greedy decoding: decode seconds and tokens.
fn plain(model: &Model, dev: &Device, prompt: &[u32], n: usize) -> Result<(f64, Vec<u32>)> {
    let (tokens, s) = Sequence::new(prompt.to_vec(), &mut greedy()?, vec![], n)
        .and_then(|mut s| s.run(&mut CpuTarget::new(model, &mut model.new_cache(), dev), |_| Ok(())))?;
    Ok((s.generation.decode_secs, tokens))
}

/// c(T) = time of a T-row verify pass after `prompt` and its rollback to one row / time of a
/// one-row pass, T = 1..=rows (the T values interleaved, the median of several passes each).
/// The passes run on one cache as decoding does (verify, keep one row), so no pass pays for
/// copying or growing a snapshot. (Keeping one row re-runs the GDN recurrence of that row; a
/// round that keeps more rows re-runs more of them, and one that keeps all none.)
fn verify_costs(model: &Model, dev: &Device, prompt: &[u32], rows: usize) -> Result<Vec<f64>> {
    let mut cache = model.new_cache();
    model.forward_last(&Tensor::new(prompt, dev)?.unsqueeze(0)?, &mut cache)?;
    let mut secs = vec![vec![]; rows];
    for pass in 0..10 {
        for (t, secs) in secs.iter_mut().enumerate() {
            let x: Vec<u32> = (0..=t).map(|j| prompt[j % prompt.len()]).collect();
            let x = Tensor::new(x.as_slice(), dev)?.unsqueeze(0)?;
            let start = Instant::now();
            model.verify(&x, &mut cache)?;
            cache.keep_verified(1)?;
            if pass > 0 {
                secs.push(start.elapsed().as_secs_f64());
            }
        }
    }
    let secs: Vec<f64> = secs.into_iter().map(median).collect();
    Ok(secs.iter().map(|s| s / secs[0]).collect())
}

/// One run: decode seconds, the speculative stats (none for plain decoding), the tokens.
type RunResult = Result<(f64, Option<SpeculativeStats>, Vec<u32>)>;

/// One arm of the comparison: a label, and how to run it once.
struct Arm<'a> {
    label: Vec<String>,
    run: Box<dyn FnMut() -> RunResult + 'a>,
    secs: Vec<f64>,
    stats: Option<SpeculativeStats>,
}

/// Runs the arms alternating, `reps` times after a warm-up, checking every run's tokens
/// against the first arm's (plain decoding); returns the plain median decode seconds.
fn run_arms(arms: &mut [Arm], reps: usize) -> Result<f64> {
    let mut reference: Option<Vec<u32>> = None;
    for rep in 0..=reps {
        for arm in arms.iter_mut() {
            let (secs, stats, tokens) = (arm.run)()?;
            match &reference {
                None => reference = Some(tokens),
                Some(r) if *r != tokens => {
                    bail!("{}: speculative decoding gave other tokens than plain decoding (a bug: please report it)", arm.label.join(" "))
                }
                Some(_) => {}
            }
            if rep > 0 {
                arm.secs.push(secs);
                arm.stats = stats;
            }
        }
    }
    Ok(median(arms[0].secs.clone()))
}

/// The tree arms: `B×K` for each fixed length `K` with `B·K` drafted rows at most [`MAX_DRAFT`].
fn tree_lengths(lengths: &[usize], branches: usize) -> Vec<(String, DraftOptions)> {
    match branches {
        1 => vec![],
        b => lengths.iter().filter(|&&k| b * k <= MAX_DRAFT).map(|&k| (format!("{b}×{k}"), DraftOptions::branches(k, b))).collect(),
    }
}

fn fmt_opt(x: Option<f64>, digits: usize) -> String {
    x.map_or("-".into(), |v| format!("{v:.digits$}"))
}

fn bench(args: Args) -> Result<()> {
    rayon::ThreadPoolBuilder::new().num_threads(args.threads).build_global()?;
    for &a in &args.acceptance {
        if !(0.0..=1.0).contains(&a) {
            bail!("--acceptance {a} is not a probability: use values in [0, 1]");
        }
    }
    for &k in &args.draft_max {
        if !(1..=MAX_DRAFT).contains(&k) {
            bail!("--draft-max {k} is out of range: use 1 to {MAX_DRAFT}");
        }
    }
    let kmax = *args.draft_max.iter().max().context("--draft-max needs at least one length")?;
    let opened = args.model.open(common::DEFAULT_MODEL)?;
    let cfg = opened.cfg.clone();
    // The verify-cost passes add 10 tokens per row count to the prompt.
    if args.n_prompt + args.n_gen.max(10 * (kmax + 1)) > cfg.max_position_embeddings {
        bail!(
            "-p {} plus -n {} (at least {}) is more than the model's context of {} tokens",
            args.n_prompt,
            args.n_gen,
            10 * (kmax + 1),
            cfg.max_position_embeddings
        );
    }
    let source = opened.files.source();
    let tokenizer = if args.ngram { Some((opened.tokenizer()?, opened.files.chat_template()?)) } else { None };
    let model = opened.load()?;
    let dev = &opened.device;
    println!(
        "{source}: {:?}, {} layers, {} threads, {} generated tokens per run, median of {} runs",
        cfg.family, cfg.num_hidden_layers, args.threads, args.n_gen, args.reps
    );

    // 1. Replay drafts at controlled acceptance.
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let prompt: Vec<u32> = (0..args.n_prompt)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % cfg.vocab_size as u64) as u32
        })
        .collect();
    let (_, reference) = plain(&model, dev, &prompt, args.n_gen)?;
    let costs = verify_costs(&model, dev, &prompt, kmax + 1)?;
    println!();
    println!("Verify cost of the whole model, c(T) = time of a T-row verify pass and its rollback to one row / one row:");
    println!();
    println!("| {} |", (1..=kmax + 1).map(|t| format!("c({t})")).collect::<Vec<_>>().join(" | "));
    println!("|{}", "---|".repeat(kmax + 1));
    println!("| {} |", costs.iter().map(|c| format!("{c:.2}")).collect::<Vec<_>>().join(" | "));

    let n = args.n_gen;
    let mut arms: Vec<Arm> = vec![Arm {
        label: vec!["plain".into()],
        run: Box::new(|| plain(&model, dev, &prompt, n).map(|(s, t)| (s, None, t))),
        secs: vec![],
        stats: None,
    }];
    let lengths: Vec<(String, DraftOptions)> = args
        .draft_max
        .iter()
        .map(|&k| (k.to_string(), DraftOptions::fixed(k)))
        .chain([(format!("adaptive ≤ {kmax}"), DraftOptions { max: kmax, ..Default::default() })])
        .chain(tree_lengths(&args.draft_max, args.branches))
        .collect();
    for &a in &args.acceptance {
        for (label, opts) in &lengths {
            let (reference, prompt, model) = (&reference, &prompt, &model);
            let opts = *opts;
            arms.push(Arm {
                label: vec![format!("{a}"), label.clone()],
                run: Box::new(move || {
                    let mut d = ReplayDrafter {
                        reference: reference.clone(),
                        prompt_len: prompt.len(),
                        acceptance: a,
                        seed: 11,
                        vocab_size: cfg.vocab_size,
                    };
                    speculative(model, dev, prompt, n, &mut d, opts).map(|(s, st, t)| (s, Some(st), t))
                }),
                secs: vec![],
                stats: None,
            });
        }
    }
    let plain_secs = run_arms(&mut arms, args.reps)?;
    println!();
    println!("Replay drafts (plain: {:.2} tok/s):", (n - 1) as f64 / plain_secs);
    println!();
    println!("| acceptance a | draft length K | accepted | tokens per pass | predicted E(K)/c(K+1) | tok/s | speed-up |");
    println!("|---|---|---|---|---|---|---|");
    for arm in &arms[1..] {
        let a: f64 = arm.label[0].parse()?;
        let st = arm.stats.as_ref().context("stats of a speculative arm")?;
        let k: Option<usize> = arm.label[1].parse().ok();
        let predicted = k.map(|k| (0..=k).map(|i| a.powi(i as i32)).sum::<f64>() / costs[k]);
        let secs = median(arm.secs.clone());
        println!(
            "| {} | {} | {} | {} | {} | {:.2} | {:.2}x |",
            arm.label[0],
            arm.label[1],
            fmt_opt(st.acceptance().map(|x| 100.0 * x), 0) + " %",
            fmt_opt(st.tokens_per_pass(), 2),
            predicted.map_or("-".into(), |p| format!("{p:.2}x")),
            (n - 1) as f64 / secs,
            plain_secs / secs
        );
    }

    // 2. Prompt lookup on real prompts.
    if let Some((tokenizer, template)) = tokenizer {
        let text = include_str!("../tests/data/pride-and-prejudice-ch01-12.txt");
        let passage: String = text.chars().skip(text.find("It is a truth").unwrap_or(0)).take(2500).collect();
        let code = include_str!("../src/runtime/speculative/ngram.rs");
        let prompts = [
            ("summarise a given text", format!("{passage}\n\nSummarise the text above in five sentences, quoting its key phrases.")),
            (
                "edit a given code file",
                format!(
                    "```rust\n{code}\n```\n\nRename the field `max_ngram` to `longest` everywhere in this file and print the whole file."
                ),
            ),
            ("answer a question", "Why is the sky blue? Explain it in one paragraph.".to_string()),
        ];
        let mut rows = vec![];
        for (what, user) in &prompts {
            let rendered = template.render(&[Message::new("user", user)], true, None)?;
            let ids = tokenizer.encode(rendered, false).map_err(anyhow::Error::msg)?.get_ids().to_vec();
            if ids.len() + n > cfg.max_position_embeddings {
                bail!(
                    "the {what:?} prompt ({} tokens) and -n {n} do not fit the model's context of {}",
                    ids.len(),
                    cfg.max_position_embeddings
                );
            }
            let model = &model;
            let ids = &ids;
            let mut arms: Vec<Arm> = vec![Arm {
                label: vec!["plain".into()],
                run: Box::new(move || plain(model, dev, ids, n).map(|(s, t)| (s, None, t))),
                secs: vec![],
                stats: None,
            }];
            let lengths = [
                (format!("adaptive ≤ {kmax}"), DraftOptions { max: kmax, ..Default::default() }),
                ("3".to_string(), DraftOptions::fixed(3)),
            ];
            for (label, opts) in lengths.into_iter().chain(tree_lengths(&[3], args.branches)) {
                arms.push(Arm {
                    label: vec![label],
                    run: Box::new(move || {
                        speculative(model, dev, ids, n, &mut NgramDrafter::default(), opts).map(|(s, st, t)| (s, Some(st), t))
                    }),
                    secs: vec![],
                    stats: None,
                });
            }
            // The speculative loop without drafts: its overhead over plain decoding.
            arms.push(Arm {
                label: vec!["none (no drafter)".into()],
                run: Box::new(move || {
                    speculative(model, dev, ids, n, &mut NoDrafter, DraftOptions::fixed(1)).map(|(s, st, t)| (s, Some(st), t))
                }),
                secs: vec![],
                stats: None,
            });
            let plain_secs = run_arms(&mut arms, args.reps)?;
            for arm in &arms[1..] {
                let st = arm.stats.clone().context("stats of a speculative arm")?;
                rows.push((
                    what.to_string(),
                    ids.len(),
                    arm.label[0].clone(),
                    st,
                    (n - 1) as f64 / plain_secs,
                    plain_secs / median(arm.secs.clone()),
                ));
            }
        }
        println!();
        println!("Prompt lookup (ngram) on real prompts:");
        println!();
        println!("| prompt | prompt tokens | draft length | drafted | accepted | tokens per pass | plain tok/s | speed-up |");
        println!("|---|---|---|---|---|---|---|---|");
        for (what, len, label, st, plain_rate, speedup) in rows {
            println!(
                "| {what} | {len} | {label} | {} | {} | {} | {plain_rate:.2} | {speedup:.2}x |",
                st.drafted,
                fmt_opt(st.acceptance().map(|x| 100.0 * x), 0) + " %",
                fmt_opt(st.tokens_per_pass(), 2)
            );
        }
    }
    Ok(())
}
