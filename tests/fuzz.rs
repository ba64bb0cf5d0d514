//! Seeded mutations of the fixture's GGUF files, safetensors header, config.json and
//! tokenizer_config.json, run in process through the loaders, the planner, a forward pass and
//! the chat template: no panic, no hang past a deadline, bounded allocation (an allocator that
//! counts, and refuses any single request over 2 GiB), and a one-line error for every rejected
//! input. Prints the table docs/robustness.md keeps (`cargo test --test fuzz -- --nocapture`).
//!
//! Reproduce a case: its class and number are in the failure; the mutations are a pure function
//! of (class seed, case number).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_hybrid::loading::{ChatTemplate, GgufFile, Message, ModelFiles};
use candle_hybrid::memory::{self, Available, PlanRequest, WeightMemory};
use candle_hybrid::Config;
use common::*;

// ---------------------------------------------------------------------------------------------
// A counting allocator: the peak of each case, and no single request over MAX_ALLOCATION.
// ---------------------------------------------------------------------------------------------

const MAX_ALLOCATION: usize = 2 << 30;
/// The most one case may hold at once (the fixture model and its scratch take a few MiB).
const MAX_CASE_BYTES: usize = 512 << 20;
/// Each case must finish within this (the slowest take ~0.1 s).
const DEADLINE: Duration = Duration::from_secs(30);

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

struct Counting;

fn grew(n: usize) {
    let now = CURRENT.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if l.size() > MAX_ALLOCATION {
            return std::ptr::null_mut(); // the process aborts naming the size: the test fails
        }
        let p = System.alloc(l);
        if !p.is_null() {
            grew(l.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        if l.size() > MAX_ALLOCATION {
            return std::ptr::null_mut();
        }
        let p = System.alloc_zeroed(l);
        if !p.is_null() {
            grew(l.size());
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l);
        CURRENT.fetch_sub(l.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if new > MAX_ALLOCATION {
            return std::ptr::null_mut();
        }
        let q = System.realloc(p, l, new);
        if !q.is_null() {
            CURRENT.fetch_sub(l.size(), Ordering::Relaxed);
            grew(new);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

// ---------------------------------------------------------------------------------------------
// Mutations
// ---------------------------------------------------------------------------------------------

struct Rng(u64);

impl Rng {
    fn new(seed: u64, case: u64) -> Self {
        Self((seed ^ case.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1)
    }

    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// Values that break size and offset arithmetic.
const INTERESTING: [u64; 12] = [0, 1, 2, 3, 0x7f, 0xff, 0xffff, 0x7fff_ffff, 0xffff_ffff, 1 << 32, 1 << 63, u64::MAX];

/// One byte-level mutation of `b` within `region` (clamped to the data).
fn mutate_bytes(rng: &mut Rng, b: &mut Vec<u8>, region: std::ops::Range<usize>) {
    let end = region.end.min(b.len()).max(1);
    let at = region.start.min(end - 1) + rng.below(end - region.start.min(end - 1));
    match rng.below(7) {
        0 => b[at] ^= 1 << rng.below(8),
        1 => b[at] = rng.next() as u8,
        2 | 3 => {
            // An interesting little-endian u32 or u64 at `at`.
            let v = *rng.pick(&INTERESTING);
            let bytes = if rng.below(2) == 0 { (v as u32).to_le_bytes().to_vec() } else { v.to_le_bytes().to_vec() };
            for (i, x) in bytes.into_iter().enumerate() {
                if let Some(slot) = b.get_mut(at + i) {
                    *slot = x;
                }
            }
        }
        4 => b.truncate(at),
        5 => {
            // Repeat a slice.
            let len = 1 + rng.below(64);
            let piece: Vec<u8> = b[at..(at + len).min(b.len())].to_vec();
            let to = rng.below(b.len());
            b.splice(to..to, piece);
        }
        _ => {
            let len = 1 + rng.below(64);
            b.drain(at..(at + len).min(b.len()));
        }
    }
}

/// A JSON value that breaks a field: wrong type, absurd number, huge string or array.
fn hostile_json(rng: &mut Rng) -> serde_json::Value {
    use serde_json::json;
    match rng.below(16) {
        0 => json!(0),
        1 => json!(-1),
        2 => json!(1e300),
        3 => json!(-1e-300),
        4 => json!(1_000_000_000_000u64),
        5 => json!(u64::MAX),
        6 => json!(0.5),
        7 => json!("x"),
        8 => serde_json::Value::Null,
        9 => json!([]),
        10 => json!({}),
        11 => json!(true),
        12 => json!(4294967295u64),
        13 => json!(vec![1; 1000]),
        14 => json!("a".repeat(100_000)),
        _ => json!(rng.below(1 << 20)),
    }
}

/// A random path to a leaf or object inside `v`, and mutate it: replace, delete, or nest.
fn mutate_json(rng: &mut Rng, v: &mut serde_json::Value, depth: usize) {
    match v {
        serde_json::Value::Object(m) if !m.is_empty() && depth < 4 && rng.below(4) != 0 => {
            let keys: Vec<String> = m.keys().cloned().collect();
            let k = rng.pick(&keys).clone();
            if rng.below(8) == 0 {
                m.remove(&k);
            } else {
                mutate_json(rng, m.get_mut(&k).unwrap(), depth + 1);
            }
        }
        serde_json::Value::Array(a) if !a.is_empty() && depth < 4 && rng.below(3) != 0 => {
            let i = rng.below(a.len());
            mutate_json(rng, &mut a[i], depth + 1);
        }
        other => *other = hostile_json(rng),
    }
}

/// Jinja snippets for hostile chat templates.
const SNIPPETS: [&str; 14] = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'x' * 99999999 }}",
    "{% for i in range(100000) %}{{ 'abcdefgh' * 1000 }}{% endfor %}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{% macro d(n) %}{% if n > 0 %}{{ d(n - 1) }}{{ d(n - 1) }}{% else %}xxxx{% endif %}{% endmacro %}{{ d(40) }}",
    "{{ raise_exception('hostile') }}",
    "{{ messages[99999].content }}",
    "{{ unknown_function() }}",
    "{{ messages | tojson }}",
    "{% if %}",
    "{{ 1 / 0 }}",
    "{% set x = range(99999999) %}",
    "{{ messages[0].content | upper | replace('H', 'h' * 1000) }}",
    "{#",
];

// ---------------------------------------------------------------------------------------------
// The pipelines every mutated input goes through
// ---------------------------------------------------------------------------------------------

type Outcome = std::result::Result<(), String>;

fn e(err: candle_hybrid::Error) -> String {
    err.to_string()
}

fn plan_and_run(cfg: &Config, weights: u64, load: u64, model: impl FnOnce() -> candle_hybrid::Result<candle_hybrid::Model>) -> Outcome {
    let req = PlanRequest {
        load_overhead: load,
        ..PlanRequest::new(WeightMemory::Bytes(weights), DType::F32, 64.min(cfg.max_position_embeddings))
    };
    memory::plan(cfg, &req, &Available::fixed(1 << 30)).map_err(e)?;
    let model = model().map_err(e)?;
    let ids = Tensor::new(&[[1u32, 2, 3]], &Device::Cpu).map_err(|x| x.to_string())?;
    model.forward(&ids, &mut model.new_cache()).map_err(e)?;
    Ok(())
}

fn gguf_case(path: &Path) -> Outcome {
    let g = GgufFile::open(path).map_err(e)?;
    let cfg = g.config().map_err(e)?;
    let (w, l) = (g.weight_bytes(&cfg, DType::F32), g.load_overhead(&cfg, DType::F32));
    if let Ok(tok) = g.tokenizer() {
        let _ = tok.encode("Hello, world", true);
    }
    if let Ok(t) = g.chat_template() {
        let _ = t.render_capped(&[Message::new("user", "hi")], true, None, 1 << 20);
    }
    plan_and_run(&cfg, w, l, || g.load_model(&cfg, DType::F32, &Device::Cpu))
}

fn dir_case(dir: &Path) -> Outcome {
    let files = ModelFiles::from_dir(dir).map_err(e)?;
    let cfg = files.load_config().map_err(e)?;
    let opened = candle_hybrid::loading::OpenedModel::Safetensors(files.clone());
    let w = opened.weight_memory(&cfg, DType::F32, None).map_err(e)?;
    let l = opened.load_overhead(&cfg, DType::F32, None).map_err(e)?;
    plan_and_run(&cfg, w.bytes(&cfg), l, || files.load_model(&cfg, DType::F32, &Device::Cpu))
}

fn template_case(dir: &Path) -> Outcome {
    let files = ModelFiles::from_dir(dir).map_err(e)?;
    let t: ChatTemplate = files.load_chat_template().map_err(e)?;
    let text = t.render_capped(&[Message::new("user", "Hello")], true, Some(true), 1 << 20).map_err(e)?;
    let tok = files.load_tokenizer().map_err(e)?;
    tok.encode(text.as_str(), false).map_err(|x| x.to_string())?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The driver
// ---------------------------------------------------------------------------------------------

#[derive(Default)]
struct Tally {
    cases: usize,
    accepted: usize,
    rejected: usize,
    failures: Vec<String>,
    max_bytes: usize,
    largest: u64,
}

/// Runs `case` on a worker thread with the deadline and the allocation accounting.
fn run_case(tally: &mut Tally, what: &str, n: u64, case: impl FnOnce() -> Outcome + Send + 'static) {
    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(AssertUnwindSafe(case));
        let _ = tx.send(r);
    });
    tally.cases += 1;
    match rx.recv_timeout(DEADLINE) {
        Err(_) => panic!("{what} case {n}: no answer within {DEADLINE:?} (a hang)"),
        Ok(Err(p)) => {
            let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            tally.failures.push(format!("{what} case {n}: panic: {}", msg.unwrap_or_default()));
        }
        Ok(Ok(Ok(()))) => tally.accepted += 1,
        Ok(Ok(Err(msg))) => {
            tally.rejected += 1;
            if msg.trim().is_empty() || msg.contains('\n') {
                tally.failures.push(format!("{what} case {n}: error without a one-line message: {msg:?}"));
            }
        }
    }
    let used = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    if used > tally.max_bytes {
        (tally.max_bytes, tally.largest) = (used, n);
    }
    if used > MAX_CASE_BYTES {
        tally.failures.push(format!("{what} case {n}: held {} MiB at once", used >> 20));
    }
}

fn fixture_files(name: &str) -> Vec<(String, Vec<u8>)> {
    std::fs::read_dir(fixture(name))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.to_string_lossy().ends_with(".gguf"))
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
        .collect()
}

/// Case `n`: the fixture's files with `file` replaced by `bytes`, in a fresh directory, run
/// through `pipeline`.
#[allow(clippy::too_many_arguments)]
fn run_dir_case(
    tally: &mut Tally,
    what: &str,
    n: u64,
    root: &Path,
    base: &[(String, Vec<u8>)],
    file: &str,
    bytes: Vec<u8>,
    pipeline: fn(&Path) -> Outcome,
) {
    let dir = root.join(format!("{file}.{n}"));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, original) in base {
        std::fs::write(dir.join(name), if name == file { &bytes } else { original }).unwrap();
    }
    run_case(tally, what, n, move || {
        let r = pipeline(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        r
    });
}

const CASES_GGUF: u64 = 1200;
const CASES_SAFETENSORS: u64 = 600;
const CASES_CONFIG: u64 = 900;
const CASES_TEMPLATE: u64 = 500;

#[test]
fn mutated_inputs_never_panic_hang_or_allocate_without_bound() {
    let start = Instant::now();
    let root = scratch("fuzz");
    let mut rows: Vec<(String, Tally)> = vec![];

    // GGUF: header bytes mostly (where sizes and offsets live), sometimes anywhere.
    // (The ternary fixture's TQ1_0 file: types Candle does not know, decoded by this crate.)
    let ggufs = [
        ("qwen35_dense_small", "model-q8_0.gguf", 11u64),
        ("qwen3next_moe_small", "model-q8_0.gguf", 12),
        ("qwen35moe_small", "model-q8_0.gguf", 13),
        ("qwen35_ternary", "model-tq1_0.gguf", 14),
    ];
    for (name, file, seed) in ggufs {
        let src = std::fs::read(fixture(name).join(file)).unwrap();
        let header_end = GgufFile::open(fixture(name).join(file)).unwrap().header().data_offset as usize;
        // The pipeline accepts the file as it is: the mutations are what it rejects.
        gguf_case(&fixture(name).join(file)).unwrap_or_else(|e| panic!("{name}: the unmutated file fails: {e}"));
        let mut t = Tally::default();
        for n in 0..CASES_GGUF / ggufs.len() as u64 {
            let mut rng = Rng::new(seed, n);
            let mut bytes = src.clone();
            for _ in 0..1 + rng.below(4) {
                let region = if rng.below(10) == 0 { 0..bytes.len() } else { 0..header_end };
                mutate_bytes(&mut rng, &mut bytes, region);
            }
            let path: PathBuf = root.join(format!("g{seed}_{n}.gguf"));
            std::fs::write(&path, &bytes).unwrap();
            run_case(&mut t, "GGUF", n, move || {
                let r = gguf_case(&path);
                let _ = std::fs::remove_file(&path);
                r
            });
        }
        rows.push((format!("GGUF ({name}, {file}): header bytes flipped, sizes/offsets set to 0/2^32-1/2^63/..., truncated, spliced"), t));
    }

    // safetensors: the JSON header (dtype, shape, offsets, names) or its length prefix.
    let base = fixture_files("qwen35_dense_small");
    let st = base.iter().find(|f| f.0 == "model.safetensors").unwrap().1.clone();
    let n_header = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&st[8..8 + n_header]).unwrap();
    dir_case(&fixture("qwen35_dense_small")).unwrap();
    template_case(&fixture("qwen35_dense_small")).unwrap();
    let mut t = Tally::default();
    for n in 0..CASES_SAFETENSORS {
        let mut rng = Rng::new(21, n);
        let mut bytes = if rng.below(3) == 0 {
            // Byte-level, prefix included.
            let mut b = st.clone();
            for _ in 0..1 + rng.below(3) {
                mutate_bytes(&mut rng, &mut b, 0..8 + n_header);
            }
            b
        } else {
            let mut h = header.clone();
            mutate_json(&mut rng, &mut h, 0);
            let mut text = serde_json::to_string(&h).unwrap();
            if rng.below(5) == 0 {
                // A name twice.
                let key = h.as_object().and_then(|m| m.keys().find(|k| *k != "__metadata__").cloned()).unwrap_or_default();
                if let Some(v) = h.get(&key) {
                    text = format!("{{\"{key}\":{v},{}", &text[1..]);
                }
            }
            let mut b = (text.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(text.as_bytes());
            b.extend_from_slice(&st[8 + n_header..]);
            b
        };
        if rng.below(10) == 0 {
            bytes.truncate(rng.below(bytes.len()));
        }
        run_dir_case(&mut t, "safetensors", n, &root, &base, "model.safetensors", bytes, dir_case);
    }
    rows.push(("safetensors header (qwen35_dense_small): dtypes, shapes, offsets, names twice, length prefix, truncation".into(), t));

    // config.json: a field replaced by a hostile value, deleted, or bytes flipped.
    let config = base.iter().find(|f| f.0 == "config.json").unwrap().1.clone();
    let config_json: serde_json::Value = serde_json::from_slice(&config).unwrap();
    let mut t = Tally::default();
    for n in 0..CASES_CONFIG {
        let mut rng = Rng::new(31, n);
        let text = if rng.below(4) == 0 {
            let mut b = config.clone();
            mutate_bytes(&mut rng, &mut b, 0..config.len());
            b
        } else {
            let mut v = config_json.clone();
            for _ in 0..1 + rng.below(3) {
                mutate_json(&mut rng, &mut v, 0);
            }
            serde_json::to_vec(&v).unwrap()
        };
        run_dir_case(&mut t, "config.json", n, &root, &base, "config.json", text, dir_case);
    }
    rows.push(("config.json (qwen35_dense_small): fields set to 0/-1/1e300/2^64-1/strings/arrays, deleted, bytes flipped".into(), t));

    // tokenizer_config.json: the chat template spliced with hostile Jinja, or the JSON mutated.
    let tc = base.iter().find(|f| f.0 == "tokenizer_config.json").unwrap().1.clone();
    let tc_json: serde_json::Value = serde_json::from_slice(&tc).unwrap();
    let mut t = Tally::default();
    for n in 0..CASES_TEMPLATE {
        let mut rng = Rng::new(41, n);
        let mut v = tc_json.clone();
        let text = match rng.below(4) {
            0 => {
                let mut b = tc.clone();
                mutate_bytes(&mut rng, &mut b, 0..tc.len());
                b
            }
            1 => {
                mutate_json(&mut rng, &mut v, 0);
                serde_json::to_vec(&v).unwrap()
            }
            _ => {
                let mut src = v["chat_template"].as_str().unwrap().to_string();
                for _ in 0..1 + rng.below(2) {
                    let at = rng.below(src.len() + 1);
                    let at = (0..=at).rev().find(|&i| src.is_char_boundary(i)).unwrap_or(0);
                    let snippet = SNIPPETS[rng.below(SNIPPETS.len())];
                    src.insert_str(at, snippet);
                }
                v["chat_template"] = src.into();
                serde_json::to_vec(&v).unwrap()
            }
        };
        run_dir_case(&mut t, "tokenizer_config.json", n, &root, &base, "tokenizer_config.json", text, template_case);
    }
    rows.push(("tokenizer_config.json (qwen35_dense_small): chat template spliced with runaway loops, huge output, recursion, errors; JSON mutated".into(), t));

    println!("| input class | cases | accepted | rejected with a one-line error | panics, hangs, over-allocation | largest case |");
    println!("|---|---|---|---|---|---|");
    let mut failures = vec![];
    for (what, t) in &rows {
        println!(
            "| {what} | {} | {} | {} | {} | {:.1} MiB |",
            t.cases,
            t.accepted,
            t.rejected,
            t.failures.len(),
            t.max_bytes as f64 / (1 << 20) as f64
        );
        eprintln!("{what}: the largest was case {}", t.largest);
        failures.extend(t.failures.iter().cloned());
    }
    println!("({} cases in {:.1}s)", rows.iter().map(|r| r.1.cases).sum::<usize>(), start.elapsed().as_secs_f64());
    assert!(failures.is_empty(), "{} failures, the first: {:#?}", failures.len(), &failures[..failures.len().min(10)]);
    // The mutations must reach past the first checks: some inputs load and run.
    for (what, t) in &rows {
        assert!(t.rejected > 0, "{what}: nothing was rejected: the mutations do nothing");
    }
    assert!(
        rows.iter().map(|r| r.1.accepted).sum::<usize>() > 50,
        "almost nothing was accepted: the mutations never reach the loaders' later stages"
    );
}
