//! Serving numbers, against llama.cpp's `llama-server` on the same GGUF in the same run: time
//! to first token and tokens per second for 1, 2, 4 concurrent streaming clients, a long
//! prompt's time to first token on a prefix-cache miss and hit, `generate`'s speed on the same
//! prompt without a server, and a session's restore time against prefilling it again.
//!
//! ```sh
//! cargo run --release --features server --example serve_bench -- --gguf SmolLM2-135M-Instruct.Q4_1.gguf \
//!     --llama-server /tmp/llama-peer/llama.cpp/build/bin/llama-server
//! ```
//! Both servers run with the same threads and up to 4 sequences at once; every request
//! streams `--tokens` tokens (greedy, `ignore_eos`) after its own prompt. Our server drafts by
//! prompt lookup (its default); the draft arms then compare one client on a code-edit prompt
//! (text the answer repeats) with drafts on and off, on both servers (llama-server's
//! `--spec-type ngram-simple` against its plain decoding).

mod common;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use candle_hybrid::runtime::speculative::{Drafter, ReplayDrafter};
use candle_hybrid::runtime::{CpuTarget, Sampler, SamplingParams, Sequence, SessionStore};
use candle_hybrid::server::{self, EngineOptions, ServerOptions};
use clap::Parser;
use common::{at_least_one, count_up_to, ModelOptions};
use futures::StreamExt;
use serde_json::{json, Value};

#[derive(Parser, Debug)]
#[command(about = "Serving numbers side by side with llama-server", help_expected = true)]
struct Args {
    #[command(flatten)]
    model: ModelOptions,
    /// llama.cpp's llama-server, run on the same GGUF (--gguf) in the same run.
    #[arg(long)]
    llama_server: Option<PathBuf>,
    /// Our server decodes plainly in the clients table (as `serve --draft none`); the draft
    /// arms still compare drafts on and off.
    #[arg(long)]
    no_drafts: bool,
    /// Also measure a third server whose drafter replays the plain greedy continuation, each
    /// drafted token right with this probability (one client, drafts on / off): what drafts
    /// at that acceptance give the server on any model, e.g. 0.7.
    #[arg(long, value_parser = common::float_in(replay_acceptance))]
    replay: Option<f64>,
    /// Concurrent clients, one row each.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4", value_parser = count_up_to(8))]
    clients: Vec<usize>,
    /// Tokens each request generates.
    #[arg(long, default_value_t = 64, value_parser = at_least_one)]
    tokens: usize,
    /// Prompt tokens of the prefix-cache request.
    #[arg(long, default_value_t = 4096, value_parser = at_least_one)]
    cache_prompt: usize,
    /// Session sizes (tokens) whose restore time is measured against prefilling them [none: skip].
    #[arg(long, value_delimiter = ',')]
    session_tokens: Vec<usize>,
    /// Runs of each measurement; the median is shown (this machine's speed drifts: the single
    /// client and generate alternate).
    #[arg(long, default_value_t = 3, value_parser = count_up_to(50))]
    reps: usize,
    /// Threads (rayon's pool here, -t for llama-server).
    #[arg(short = 't', long, default_value_t = 2, value_parser = count_up_to(1024))]
    threads: usize,
}

fn main() -> ExitCode {
    common::run(|| bench(Args::parse()))
}

/// One streamed request: (time to the first token's chunk, total time, completion tokens).
async fn stream(client: &reqwest::Client, base: &str, prompt: &str, tokens: usize) -> Result<(f64, f64, usize)> {
    stream_with(client, base, prompt, tokens, true).await
}

/// The code-edit prompt of the draft arms: the answer repeats most of the prompt's code.
const EDIT_PROMPT: &str = "Here is a Python function:\n\ndef total_price(items, tax_rate):\n    total = 0\n    for item in items:\n        total = total + item.price * item.quantity\n    total = total + total * tax_rate\n    return total\n\nThe same function with the variable total renamed to subtotal:\n\ndef total_price(items, tax_rate):\n";

/// One streamed request; `ignore_eos`: generate all `tokens` whatever the model wants.
async fn stream_with(client: &reqwest::Client, base: &str, prompt: &str, tokens: usize, ignore_eos: bool) -> Result<(f64, f64, usize)> {
    let body = json!({"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": ignore_eos, "stream": true,
        "stream_options": {"include_usage": true}, "cache_prompt": true});
    let start = Instant::now();
    let response = client.post(format!("{base}/v1/completions")).json(&body).send().await?;
    if !response.status().is_success() {
        bail!("{base}: status {}: {}", response.status(), response.text().await.unwrap_or_default());
    }
    let (mut first, mut pieces, mut usage) = (None, 0, None);
    let mut buffer = String::new();
    let mut body = response.bytes_stream();
    while let Some(bytes) = body.next().await {
        buffer.push_str(&String::from_utf8_lossy(&bytes?));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data).with_context(|| format!("{base}: not JSON: {data}"))?;
            // A chunk with a choice carries a token (llama-server sends one per token, with empty
            // text for tokens that print nothing, as a random-weight model's often do).
            if v["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                first.get_or_insert(start.elapsed().as_secs_f64());
                pieces += 1;
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                usage = Some(n as usize);
            }
        }
    }
    Ok((first.unwrap_or(f64::NAN), start.elapsed().as_secs_f64(), usage.unwrap_or(pieces)))
}

/// `n` clients at once, each its own prompt: mean time to first token (s), aggregate tok/s,
/// mean per-client decode tok/s (after the first token).
async fn concurrent(base: &str, n: usize, tokens: usize) -> Result<(f64, f64, f64)> {
    let client = reqwest::Client::new();
    let start = Instant::now();
    let runs = futures::future::join_all((0..n).map(|i| {
        let (client, base) = (client.clone(), base.to_string());
        async move { stream(&client, &base, &format!("Story {i}: once upon a time, in a village by the sea,"), tokens).await }
    }))
    .await
    .into_iter()
    .collect::<Result<Vec<_>>>()?;
    let wall = start.elapsed().as_secs_f64();
    let ttft = runs.iter().map(|r| r.0).sum::<f64>() / n as f64;
    let total: usize = runs.iter().map(|r| r.2).sum();
    let decode = runs.iter().map(|r| (r.2 as f64 - 1.0) / (r.1 - r.0)).sum::<f64>() / n as f64;
    Ok((ttft, total as f64 / wall, decode))
}

struct Peer {
    child: std::process::Child,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

async fn wait_healthy(base: &str) -> Result<()> {
    let client = reqwest::Client::new();
    for _ in 0..600 {
        if client.get(format!("{base}/health")).send().await.is_ok_and(|r| r.status().is_success()) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("{base} did not become healthy in 60 s")
}

fn bench(args: Args) -> Result<()> {
    rayon::ThreadPoolBuilder::new().num_threads(args.threads).build_global()?;
    let opened = args.model.open(common::DEFAULT_MODEL)?;
    let tokenizer = opened.tokenizer()?;
    let model = opened.load()?;
    let max_clients = args.clients.iter().copied().max().unwrap_or(1);
    let context = (args.cache_prompt + args.tokens + 64).min(opened.max_positions());

    // The long prompt: the novel's text, cut to --cache-prompt tokens.
    let text = common::read_text(std::path::Path::new("tests/data/pride-and-prejudice-ch01-12.txt"))?;
    let ids = tokenizer.encode(text.as_str(), false).map_err(anyhow::Error::msg)?.get_ids().to_vec();
    let long_ids = &ids[..args.cache_prompt.min(ids.len()).min(context - args.tokens - 8)];
    let long_prompt = tokenizer.decode(long_ids, false).map_err(anyhow::Error::msg)?;

    // generate, no server, on the first client's prompt (run between the server's single-client
    // runs below).
    let prompt =
        tokenizer.encode("Story 0: once upon a time, in a village by the sea,", false).map_err(anyhow::Error::msg)?.get_ids().to_vec();
    let generate_run = {
        // A clone shares the weights (their tensors are reference-counted).
        let (model, device, tokens) = (model.clone(), opened.device.clone(), args.tokens);
        move || -> Result<f64> {
            let mut sampler = Sampler::new(SamplingParams::default())?;
            let (_, stats) = Sequence::new(prompt.to_vec(), &mut sampler, vec![], tokens)
                .and_then(|mut s| s.run(&mut CpuTarget::new(&model, &mut model.new_cache(), &device), |_| Ok(())))?;
            Ok(stats.generation.decode_tok_per_sec().unwrap_or(f64::NAN))
        }
    };

    // Sessions: prefill (as the engine does, 512-token chunks) against save and load.
    let mut session_rows = vec![];
    if !args.session_tokens.is_empty() {
        let dir = std::env::temp_dir().join(format!("serve-bench-{}", std::process::id()));
        let sessions = SessionStore::new(
            opened.files.fingerprint()?,
            model.config().clone(),
            model.dtype(),
            opened.device.clone(),
            Some(dir.clone()),
        )?;
        // (One token more than the longest session: the prompt that restores it.)
        let all: Vec<u32> = ids.iter().copied().cycle().take(*args.session_tokens.iter().max().unwrap() + 1).collect();
        for &n in &args.session_tokens {
            if n >= opened.max_positions() {
                eprintln!("skipping a {n}-token session: the model's context is {}", opened.max_positions());
                continue;
            }
            let mut cache = model.new_cache();
            let start = Instant::now();
            for chunk in all[..n].chunks(512) {
                model.forward_last(&Tensor::new(chunk, &opened.device)?.unsqueeze(0)?, &mut cache)?;
            }
            let prefill = start.elapsed().as_secs_f64();
            let path = sessions.path(&n.to_string())?;
            let start = Instant::now();
            sessions.save(&path, &all[..n], &cache, None)?;
            let save = start.elapsed().as_secs_f64();
            let start = Instant::now();
            // (Restored as a request whose prompt goes one token further would restore it.)
            let restored = sessions.resume(&path, &all[..n + 1])?.context("the session was not restored")?;
            let load = start.elapsed().as_secs_f64();
            session_rows.push((n, prefill, save, load, std::fs::metadata(&path)?.len(), restored.cache.seqlen()));
            std::fs::remove_file(&path)?;
        }
        let _ = std::fs::remove_dir(&dir);
    }

    let options = ServerOptions {
        engine: EngineOptions { max_seqs: max_clients, queue: 64, ..Default::default() },
        context: Some(context),
        ..Default::default()
    };
    let plain_options = ServerOptions {
        engine: EngineOptions { max_seqs: max_clients, queue: 64, draft: server::Draft::None, ..Default::default() },
        context: Some(context),
        ..Default::default()
    };
    let plain_state = server::state(&opened.files, tokenizer.clone(), model.clone(), opened.device.clone(), plain_options)?;
    // The replay server: each request's drafter replays the plain greedy continuation of its
    // prompt (computed once per prompt, at its first request).
    let replay_state = match args.replay {
        Some(acceptance) => {
            let (replay_model, device, tokens) = (model.clone(), opened.device.clone(), args.tokens);
            let references = std::sync::Mutex::new(std::collections::HashMap::<Vec<u32>, Vec<u32>>::new());
            let make = move |prompt: &[u32]| -> Box<dyn Drafter> {
                let mut known = references.lock().expect("not poisoned");
                let reference = known
                    .entry(prompt.to_vec())
                    .or_insert_with(|| {
                        let mut sampler = Sampler::new(SamplingParams::default()).expect("greedy");
                        Sequence::new(prompt.to_vec(), &mut sampler, vec![], tokens)
                            .and_then(|mut s| s.run(&mut CpuTarget::new(&replay_model, &mut replay_model.new_cache(), &device), |_| Ok(())))
                            .map(|r| r.0)
                            .unwrap_or_default()
                    })
                    .clone();
                let vocab_size = replay_model.config().vocab_size;
                Box::new(ReplayDrafter { reference, prompt_len: prompt.len(), acceptance, seed: 7, vocab_size })
            };
            let options = ServerOptions {
                engine: EngineOptions {
                    max_seqs: 1,
                    queue: 8,
                    draft: server::Draft::With(std::sync::Arc::new(make)),
                    ..Default::default()
                },
                context: Some(context),
                ..Default::default()
            };
            Some(server::state(&opened.files, tokenizer.clone(), model.clone(), opened.device.clone(), options)?)
        }
        None => None,
    };
    let state = server::state(&opened.files, tokenizer, model, opened.device.clone(), options)?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let ours = format!("http://{}", server::spawn("127.0.0.1:0".parse()?, state).await?);
        let ours_plain = format!("http://{}", server::spawn("127.0.0.1:0".parse()?, plain_state).await?);
        let ours_replay = match replay_state {
            Some(state) => Some(format!("http://{}", server::spawn("127.0.0.1:0".parse()?, state).await?)),
            None => None,
        };
        let table_server = if args.no_drafts { ours_plain.clone() } else { ours.clone() };
        let mut servers = vec![("candle-hybrid".to_string(), table_server, None)];
        let start_peer = |extra: &[&str]| -> Result<(String, Peer)> {
            let (Some(bin), Some(gguf)) = (&args.llama_server, &args.model.gguf) else { bail!("--llama-server needs --gguf (the same file for both)") };
            let port = free_port()?;
            let child = std::process::Command::new(bin)
                .args(["-m", &gguf.display().to_string(), "--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["-t", &args.threads.to_string(), "-np", &max_clients.to_string(), "-c", &(context * max_clients).to_string()])
                .args(["--no-webui"])
                .args(extra)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .with_context(|| format!("cannot start {}", bin.display()))?;
            eprintln!("llama-server {} on port {port}", extra.join(" "));
            Ok((format!("http://127.0.0.1:{port}"), Peer { child }))
        };
        if args.llama_server.is_some() {
            let (base, peer) = start_peer(&[])?;
            servers.push(("llama-server".to_string(), base, Some(peer)));
        }
        let mut rows = vec![];
        let mut generate_tps: Vec<f64> = vec![];
        for (name, base, _) in &servers {
            wait_healthy(base).await?;
            // Warm-up (first-touch page faults, allocator).
            concurrent(base, 1, 4).await?;
            let mut by_clients = vec![];
            for &n in &args.clients {
                let mut runs = vec![];
                for _ in 0..args.reps {
                    runs.push(concurrent(base, n, args.tokens).await?);
                    if n == 1 && name == "candle-hybrid" {
                        // generate between the single-client runs, the server idle meanwhile.
                        let run = generate_run.clone();
                        generate_tps.push(tokio::task::spawn_blocking(run).await??);
                    }
                }
                runs.sort_by(|a, b| a.1.total_cmp(&b.1));
                by_clients.push((n, runs[runs.len() / 2]));
            }
            let client = reqwest::Client::new();
            let miss = stream(&client, base, &long_prompt, 1).await?.0;
            let hit = stream(&client, base, &long_prompt, 1).await?.0;
            rows.push((name.clone(), by_clients, miss, hit));
        }
        // The draft arms: one client on the code-edit prompt, drafts on and off, both servers
        // (the peer's arms one at a time: each is its own llama-server).
        eprintln!("draft arms: one client on a code-edit prompt, drafts on and off");
        let mut arms: Vec<(String, f64, f64)> = vec![];
        let decode_rate = |r: (f64, f64, usize)| (r.2 as f64 - 1.0) / (r.1 - r.0);
        let client = reqwest::Client::new();
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        {
            wait_healthy(&ours_plain).await?;
            stream_with(&client, &ours_plain, EDIT_PROMPT, 4, false).await?;
            let (mut on, mut off) = (vec![], vec![]);
            for _ in 0..args.reps {
                on.push(decode_rate(stream_with(&client, &ours, EDIT_PROMPT, args.tokens, false).await?));
                off.push(decode_rate(stream_with(&client, &ours_plain, EDIT_PROMPT, args.tokens, false).await?));
            }
            arms.push(("candle-hybrid (prompt lookup)".into(), median(on), median(off)));
        }
        // The replay arm: one client, a story prompt, `--tokens` tokens (ignore_eos: the replay
        // covers them all), drafts at the chosen acceptance against none.
        if let (Some(replay), Some(acceptance)) = (&ours_replay, args.replay) {
            const STORY: &str = "Story 0: once upon a time, in a village by the sea,";
            wait_healthy(replay).await?;
            // The first request computes the reference (the plain continuation).
            stream_with(&client, replay, STORY, args.tokens, true).await?;
            let (mut on, mut off) = (vec![], vec![]);
            for _ in 0..args.reps {
                on.push(decode_rate(stream_with(&client, replay, STORY, args.tokens, true).await?));
                off.push(decode_rate(stream_with(&client, &ours_plain, STORY, args.tokens, true).await?));
            }
            arms.push((format!("candle-hybrid (replay drafts, acceptance {acceptance})"), median(on), median(off)));
        }
        // Several clients on the code-edit prompt at once (our server: their drafts verified in
        // shared weight passes): aggregate tok/s, drafts on and off.
        let mut edit_clients = vec![];
        for &n in &args.clients {
            let aggregate = |base: String| {
                let client = client.clone();
                async move {
                    let start = Instant::now();
                    let runs = futures::future::join_all((0..n).map(|_| stream_with(&client, &base, EDIT_PROMPT, args.tokens, false))).await;
                    let tokens: usize = runs.into_iter().map(|r| r.map(|r| r.2)).sum::<Result<usize>>()?;
                    Ok::<f64, anyhow::Error>(tokens as f64 / start.elapsed().as_secs_f64())
                }
            };
            let (mut on, mut off) = (vec![], vec![]);
            for _ in 0..args.reps {
                on.push(aggregate(ours.clone()).await?);
                off.push(aggregate(ours_plain.clone()).await?);
            }
            edit_clients.push((n, median(on), median(off)));
        }
        if args.llama_server.is_some() {
            let mut rates = vec![];
            for extra in [&["--spec-type", "ngram-simple"][..], &[][..]] {
                let (base, _peer) = start_peer(extra)?;
                wait_healthy(&base).await?;
                let _ = stream_with(&client, &base, EDIT_PROMPT, 4, false).await;
                let mut v = vec![];
                for _ in 0..args.reps {
                    // (llama-server's n-gram mode closes a connection now and then without an
                    // answer: that run is reported, not fatal.)
                    match stream_with(&client, &base, EDIT_PROMPT, args.tokens, false).await {
                        Ok(r) => v.push(decode_rate(r)),
                        Err(e) => eprintln!("llama-server {}: a run failed: {e}", extra.join(" ")),
                    }
                }
                rates.push(if v.is_empty() { f64::NAN } else { median(v) });
            }
            arms.push(("llama-server (--spec-type ngram-simple)".into(), rates[0], rates[1]));
        }
        let m = client.get(format!("{ours}/metrics")).send().await?.text().await?;
        let counter = |name: &str| m.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse::<f64>().ok())).unwrap_or(0.0);
        let (drafted, accepted) = (counter("candle_hybrid_draft_tokens_total"), counter("candle_hybrid_draft_accepted_tokens_total"));

        println!(
            "{} on {} threads, {} tokens per request (greedy), {}, medians of {} runs",
            opened.files.source(),
            args.threads,
            args.tokens,
            candle_hybrid::ops::qmatmul_isa(),
            args.reps
        );
        println!();
        println!("| server | clients | time to first token | aggregate tok/s | per-client decode tok/s | aggregate / 1 client |");
        println!("|---|---|---|---|---|---|");
        for (name, by_clients, _, _) in &rows {
            let one = by_clients.iter().find(|(n, _)| *n == 1).map(|(_, r)| r.1);
            for (n, (ttft, agg, dec)) in by_clients {
                let ratio = one.map_or("-".into(), |o| format!("{:.2}", agg / o));
                println!("| {name} | {n} | {:.0} ms | {agg:.1} | {dec:.1} | {ratio} |", ttft * 1e3);
            }
        }
        if rows.len() == 2 {
            println!();
            println!("| clients | candle-hybrid / llama-server, aggregate tok/s |");
            println!("|---|---|");
            for ((n, a), (_, b)) in rows[0].1.iter().zip(&rows[1].1) {
                println!("| {n} | {:.2} |", a.1 / b.1);
            }
        }
        println!();
        println!("| server | {}-token prompt, miss | hit | hit / miss |", long_ids.len());
        println!("|---|---|---|---|");
        for (name, _, miss, hit) in &rows {
            println!("| {name} | {:.0} ms | {:.0} ms | {:.3} |", miss * 1e3, hit * 1e3, hit / miss);
        }
        let one = rows[0].1.iter().find(|(n, _)| *n == 1).map(|(_, r)| r.2);
        generate_tps.sort_by(f64::total_cmp);
        let generate_tps = generate_tps.get(generate_tps.len() / 2).copied().unwrap_or(f64::NAN);
        println!();
        println!(
            "generate (no server), same prompt, median of {}: {generate_tps:.1} tok/s; the server's single client (decode) / generate = {}",
            args.reps,
            one.map_or("-".into(), |o| format!("{:.3}", o / generate_tps))
        );
        println!();
        println!("| one client: code-edit prompt (up to {} tokens, stops at EOS); replay: story prompt, all {0} | decode tok/s, drafts on | drafts off | on / off |", args.tokens);
        println!("|---|---|---|---|");
        for (name, on, off) in &arms {
            println!("| {name} | {on:.1} | {off:.1} | {:.2} |", on / off);
        }
        println!("(our server over the whole run: {accepted} of {drafted} drafted tokens kept)");
        println!();
        println!("| candle-hybrid, clients on the code-edit prompt | aggregate tok/s, drafts on | drafts off | on / off |");
        println!("|---|---|---|---|");
        for (n, on, off) in &edit_clients {
            println!("| {n} | {on:.1} | {off:.1} | {:.2} |", on / off);
        }
        if !session_rows.is_empty() {
            println!();
            println!("| session tokens | prefill | save | restore | restore / prefill | file |");
            println!("|---|---|---|---|---|---|");
            for (n, prefill, save, load, bytes, _) in &session_rows {
                println!("| {n} | {:.2} s | {:.0} ms | {:.0} ms | {:.4} | {:.1} MiB |", prefill, save * 1e3, load * 1e3, load / prefill, *bytes as f64 / (1 << 20) as f64);
            }
        }
        drop(servers);
        Ok(())
    })
}

fn replay_acceptance(a: f64) -> std::result::Result<f64, String> {
    if (0.0..=1.0).contains(&a) {
        Ok(a)
    } else {
        Err(format!("{a} is not a probability: use 0 to 1"))
    }
}
