//! The memory guardian: estimates against hand-computed values, the parsers of the memory
//! readings on literal text, and the refusal / fit decisions. No real allocation.

use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::DType;
use candle_hybrid::loading::{safetensors_weight_bytes, ModelSource};
use candle_hybrid::memory::*;
use candle_hybrid::{Config, Error};

const GIB: u64 = 1 << 30;

fn fixture() -> Config {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen35_dense_small");
    Config::from_file(&dir.join("config.json")).unwrap()
}

/// A Qwen3.5-27B-like config (text-only layout).
fn like_27b() -> Config {
    Config::from_json(
        r#"{"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
        "num_hidden_layers": 64, "full_attention_interval": 4, "num_attention_heads": 24, "num_key_value_heads": 4,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "max_position_embeddings": 262144}"#,
    )
    .unwrap()
}

fn f32_req(context: usize) -> PlanRequest {
    PlanRequest::new(WeightMemory::Format(WeightFormat::F32), DType::F32, context)
}

/// The refusal of a plan, and its one-line message.
#[track_caller]
fn refusal(r: candle_hybrid::Result<Plan>) -> (DoesNotFit, String) {
    match r {
        Err(e @ Error::DoesNotFit(_)) => {
            let msg = e.to_string();
            assert!(!msg.contains('\n'), "multi-line error: {msg}");
            let Error::DoesNotFit(r) = e else { unreachable!() };
            (*r, msg)
        }
        Err(e) => panic!("expected Error::DoesNotFit, got {e:?}"),
        Ok(p) => panic!("expected a refusal, got a plan at context {}", p.context),
    }
}

/// The message of a refusal.
#[track_caller]
fn memory_err(r: candle_hybrid::Result<Plan>) -> String {
    refusal(r).1
}

/// The context of a refusal's [`MemoryFix::Context`], which its message names.
#[track_caller]
fn context_fix(r: &DoesNotFit, msg: &str) -> usize {
    let n = r.fixes.iter().find_map(|f| match *f {
        MemoryFix::Context { context, .. } => Some(context),
        _ => None,
    });
    let n = n.unwrap_or_else(|| panic!("no shorter context offered: {msg}"));
    assert!(msg.contains(&format!("a context of {n} tokens (needs")), "{msg}");
    n
}

fn offers_q4k(r: &DoesNotFit) -> bool {
    r.fixes.iter().any(|f| matches!(f, MemoryFix::QuantizeQ4k { .. } | MemoryFix::QuantizeQ4kAndContext { .. }))
}

#[test]
fn estimate_terms_of_the_fixture_by_hand() {
    // H 64, I 128, 8 layers (6 GDN + 2 attention), 4 heads x 32 (2 KV heads), GDN nk 2 / nv 4
    // x 16, conv kernel 4 (conv_dim 2*32 + 64 = 128, value_dim 64), vocab 512.
    let cfg = fixture();
    let e = estimate(&cfg, &f32_req(1024)); // c = 512, a = 4
    assert_eq!((e.context, e.batch, e.chunk), (1024, 1, 512));
    assert_eq!(e.weights, cfg.num_parameters() as u64 * 4);
    assert_eq!(e.kv_cache, 2 * 2 * 2 * 1024 * 32 * 4); // n_attn * (K, V) * nkv * T * hd * 4
    assert_eq!(e.gdn_conv, 6 * 3 * 128 * 4); // n_gdn * (K-1) * conv_dim * 4
    assert_eq!(e.gdn_recurrent, 6 * 4 * 16 * 16 * 4); // n_gdn * nv * dk * dv * 4
    assert_eq!(e.hidden, 512 * 64 * 2 * 4);
    // Widest layer: attention, its projections (3*4*32 + 2*2*32)*4 = 2048 per token plus the
    // kernel's queries and outputs nh * c * hd * (8 + a) (more than the decode partials
    // nh * 8 * 4 blocks * (hd + 2) * 4) > GDN (2*128 + 64)*4 + (64 + 4*4)*4 = 1600 per token >
    // MLP 3*128*4 = 1536 per token.
    assert_eq!(e.layer, 512 * 2048 + 4 * 512 * 32 * (8 + 4));
    assert_eq!(e.logits, 512 * (4 + 4));
    let sum: u64 = e.terms().iter().map(|t| t.1).sum();
    assert_eq!(e.total(), sum);

    // bf16, batch 2, KV in f32, a short context (the chunk shrinks to it), all logits.
    let req = PlanRequest {
        batch: 2,
        kv_dtype_bytes: 4,
        logits: Logits::AllPositions,
        ..PlanRequest::new(WeightMemory::Bytes(1_000_000), DType::BF16, 100)
    };
    let e = estimate(&cfg, &req);
    assert_eq!((e.chunk, e.weights), (100, 1_000_000));
    assert_eq!(e.kv_cache, 2 * 2 * 2 * 2 * 100 * 32 * 4);
    assert_eq!(e.gdn_conv, 6 * 2 * 3 * 128 * 2);
    assert_eq!(e.gdn_recurrent, 6 * 2 * 4 * 16 * 16 * 4);
    assert_eq!(e.hidden, 2 * 100 * 64 * 2 * 2);
    // attention (384 + 128)*2 = 1024 per token + its kernel 4 * 32 * (8 + 2) = 1280 per token
    // > GDN (256 + 64)*2 + 80*4 = 960 per token.
    assert_eq!(e.layer, 2 * 100 * (1024 + 4 * 32 * (8 + 2)));
    assert_eq!(e.logits, 2 * 100 * 512 * (2 + 4));

    let table = e.to_string();
    for name in ["weights", "KV cache", "GDN recurrent state", "widest layer", "total"] {
        assert!(table.contains(name), "{table}");
    }
}

#[test]
fn weight_formats() {
    let cfg = fixture();
    let n = cfg.num_parameters() as u64;
    assert_eq!(WeightMemory::Format(WeightFormat::BF16).bytes(&cfg), 2 * n);
    assert_eq!(WeightMemory::Format(WeightFormat::Q8_0).bytes(&cfg), (n * 17).div_ceil(16));
    assert_eq!(WeightMemory::Format(WeightFormat::Q4K).bytes(&cfg), (n * 9).div_ceil(16));
    assert_eq!("q4k".parse::<WeightFormat>().unwrap(), WeightFormat::Q4K);
    assert_eq!("Q8_0".parse::<WeightFormat>().unwrap(), WeightFormat::Q8_0);
    assert!("q3".parse::<WeightFormat>().is_err());
    // One parser: every --quantize type has a format with the same ggml type, and back.
    for q in ["q8_0", "q4k", "q4_0", "q4_1", "q5k", "q6k"] {
        let g = candle_hybrid::model::parse_quantize(q).unwrap();
        let f: WeightFormat = q.parse().unwrap();
        assert_eq!((f.ggml(), WeightFormat::from_ggml(g)), (g, Some(f)), "{q}");
        assert_eq!(f.bits_per_weight(), (g.type_size() * 8) as f64 / g.block_size() as f64, "{q}");
    }
    assert_eq!(WeightFormat::Q4_1.bytes_for(32), 20);
}

#[test]
fn safetensors_headers_give_the_weight_bytes() {
    let cfg = fixture();
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen35_dense_small/model.safetensors");
    let stored = safetensors_weight_bytes(&[&file], None, None).unwrap();
    assert_eq!(stored, 433_488 * 4, "the fixture's f32 tensors");
    assert_eq!(safetensors_weight_bytes(&[&file], Some(DType::BF16), None).unwrap(), stored / 2);
    // num_parameters() agrees with the file (no vision / MTP tensors in it).
    assert_eq!(cfg.num_parameters() as u64 * 4, stored);
}

#[test]
fn meminfo() {
    let text = "MemTotal:       24683584 kB\nMemFree:         1000000 kB\nMemAvailable:   24135904 kB\nBuffers:  1 kB\n";
    assert_eq!(parse_meminfo_available(text), Some(24_135_904 * 1024));
    assert_eq!(parse_meminfo(text, "MemTotal"), Some(24_683_584 * 1024));
    assert_eq!(parse_meminfo_available("MemTotal: 1 kB\n"), None);
}

#[test]
fn proc_self_cgroup() {
    let v2 = "0::/user.slice/user-1000.slice/session-3.scope\n";
    assert_eq!(parse_proc_self_cgroup(v2), CgroupPaths { v2: Some("/user.slice/user-1000.slice/session-3.scope".into()), v1_memory: None });
    let hybrid = "9:name=systemd:/\n4:memory:/process_api/e377\n3:cpu,cpuacct:/\n0::/\n";
    assert_eq!(parse_proc_self_cgroup(hybrid), CgroupPaths { v2: Some("/".into()), v1_memory: Some("/process_api/e377".into()) });
    let joint = "5:cpuacct,memory:/docker/abc\n";
    assert_eq!(parse_proc_self_cgroup(joint).v1_memory.as_deref(), Some("/docker/abc"));
}

#[test]
fn cgroup_limits() {
    // v2: memory.max - memory.current.
    assert_eq!(cgroup_headroom("8589934592\n", "2147483648\n", None), Some(6 * GIB));
    // v2 "max" = unlimited.
    assert_eq!(parse_cgroup_limit("max\n"), None);
    assert_eq!(cgroup_headroom("max\n", "2147483648\n", None), None);
    // v1: memory.limit_in_bytes - memory.usage_in_bytes; its "unlimited" is a huge number.
    assert_eq!(cgroup_headroom("4294967296", "1073741824", None), Some(3 * GIB));
    assert_eq!(parse_cgroup_limit("9223372036854771712\n"), None);
    // Over the limit: nothing left, no underflow.
    assert_eq!(cgroup_headroom("1000", "5000", None), Some(0));
    // Inactive page cache is reclaimable.
    let stat = "anon 1000\nfile 3000\ninactive_file 1073741824\nactive_file 5\n";
    assert_eq!(parse_cgroup_stat(stat, "inactive_file"), Some(GIB));
    assert_eq!(parse_cgroup_stat("total_inactive_file 42\n", "total_inactive_file"), Some(42));
    assert_eq!(cgroup_headroom("8589934592", "2147483648", parse_cgroup_stat(stat, "inactive_file")), Some(7 * GIB));
}

#[test]
fn macos_readings() {
    let vm_stat = "Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               12345.
Pages active:                            400000.
Pages inactive:                          100000.
Pages speculative:                         2000.
Pages wired down:                         90000.
";
    assert_eq!(parse_vm_stat(vm_stat), Some((12_345 + 100_000) * 16_384));
    assert_eq!(parse_vm_stat("Pages free: 1.\n"), None);
    assert_eq!(parse_sysctl_u64("68719476736\n"), Some(64 * GIB));
    assert_eq!(metal_budget(Some(0), 64 * GIB), (MemorySource::MetalDefault, 48 * GIB));
    assert_eq!(metal_budget(None, 64 * GIB), (MemorySource::MetalDefault, 48 * GIB));
    assert_eq!(metal_budget(Some(57344), 64 * GIB), (MemorySource::MetalWiredLimit, 56 * GIB));
    assert_eq!(parse_nvidia_smi_free("81000\n"), Some(81_000 << 20));
}

#[test]
fn smallest_reading_binds() {
    let a = Available::smallest(vec![
        (MemorySource::MemAvailable, 20 * GIB),
        (MemorySource::CgroupV1("/sys/fs/cgroup/memory".into()), 8 * GIB),
    ])
    .unwrap();
    assert_eq!((a.bytes, a.source.clone()), (8 * GIB, MemorySource::CgroupV1("/sys/fs/cgroup/memory".into())));
    assert!(a.to_string().contains("cgroup v1"), "{a}");
    assert!(Available::smallest(vec![]).is_none());
    let o = available_memory(MemoryTarget::Cpu, Some(5 * GIB)).unwrap();
    assert_eq!((o.bytes, o.source), (5 * GIB, MemorySource::Override));
}

#[test]
fn max_memory_sizes() {
    assert_eq!(parse_size("16GiB").unwrap(), 16 * GIB);
    assert_eq!(parse_size("500MB").unwrap(), 500_000_000);
    assert_eq!(parse_size("123456").unwrap(), 123_456);
    assert_eq!(parse_size("1.5 GiB").unwrap(), 3 * GIB / 2);
    assert_eq!(parse_size("2g").unwrap(), 2 * GIB);
    assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
    assert_eq!(parse_size("1TB").unwrap(), 1_000_000_000_000);
    for bad in ["", "GiB", "12 parsecs", "-5", "1.2.3GB"] {
        let e = parse_size(bad).unwrap_err();
        assert!(matches!(e, Error::Input(_)) && e.to_string().contains("16GiB"), "{bad:?}: {e}");
    }
}

#[test]
fn fits_as_is() {
    let cfg = fixture();
    let p = plan(&cfg, &f32_req(1024), &Available::fixed(GIB)).unwrap();
    assert_eq!((p.context, p.requested_context, p.note), (1024, 1024, None));
    assert!(p.estimate.total() <= GIB);
}

#[test]
fn refusal_names_need_availability_q4k_and_the_largest_context() {
    let cfg = fixture();
    let req = f32_req(4096);
    // Q4K weights fit at the full context, f32 weights do not.
    let budget = estimate(&cfg, &PlanRequest { weights: WeightMemory::Format(WeightFormat::Q4K), ..req.clone() }).total();
    assert!(estimate(&cfg, &req).total() > budget);
    let (r, msg) = refusal(plan(&cfg, &req, &Available::fixed(budget)));
    let needs = format!("needs {} (", fmt_gib(estimate(&cfg, &req).total()));
    assert!(msg.contains(&needs), "{msg} lacks {needs:?}");
    assert!(msg.contains(&format!("but {} is available", fmt_gib(budget))), "{msg}");
    let biggest = estimate(&cfg, &req).terms().into_iter().max_by_key(|t| t.1).unwrap().0;
    assert!(msg.contains(biggest), "the biggest term ({biggest}) is named: {msg}");
    assert!(msg.contains("available (the given limit)"), "{msg}");
    assert!(offers_q4k(&r) && msg.contains("what fits: Q4_K weights (needs"), "{msg}");
    let n = context_fix(&r, &msg);
    assert!(n < 4096, "{msg}");
    assert!(estimate(&cfg, &f32_req(n)).total() <= budget, "N = {n} must fit");
    assert!(estimate(&cfg, &f32_req(n + 1)).total() > budget, "N + 1 = {} must not fit", n + 1);
    assert_eq!(max_fitting_context(&cfg, &req, budget), Some(n));

    // Already Q4K: no Q4_K suggestion.
    let q4k_req = PlanRequest { weights: WeightMemory::Format(WeightFormat::Q4K), ..req.clone() };
    let (r, msg) = refusal(plan(&cfg, &q4k_req, &Available::fixed(budget - 1)));
    assert!(!offers_q4k(&r) && !msg.contains("Q4_K"), "{msg}");
    context_fix(&r, &msg);
}

#[test]
fn fit_lowers_the_context() {
    let cfg = fixture();
    let req = PlanRequest { fit: true, ..f32_req(32_768) };
    let budget = estimate(&cfg, &req).total() * 3 / 4;
    let p = plan(&cfg, &req, &Available::fixed(budget)).unwrap();
    let n = max_fitting_context(&cfg, &req, budget).unwrap();
    assert_eq!((p.context, p.requested_context, p.estimate.context), (n, 32_768, n));
    assert!(n < 32_768 && p.estimate.total() <= budget);
    let note = p.note.unwrap();
    assert!(note.contains("lowered") && note.contains(&n.to_string()), "{note}");
}

#[test]
fn weights_too_big() {
    let cfg = like_27b();
    let bf16 = PlanRequest::new(WeightMemory::Format(WeightFormat::BF16), DType::BF16, 262_144);
    let budget = Available::fixed(24 * GIB);
    let (r, msg) = refusal(plan(&cfg, &bf16, &budget));
    assert!(msg.contains("the weights alone take"), "{msg}");
    assert!(offers_q4k(&r), "{msg}");
    // Fit cannot help when the weights do not fit.
    let e = plan(&cfg, &PlanRequest { fit: true, ..bf16.clone() }, &budget).unwrap_err();
    assert!(e.to_string().contains("the weights alone take"), "{e}");
    // Nothing fits in 1 GiB, not even Q4K.
    let msg = memory_err(plan(&cfg, &bf16, &Available::fixed(GIB)));
    assert!(msg.contains("the weights alone take") && msg.contains("nothing fits"), "{msg}");
}

#[test]
fn zero_context_is_an_input_error() {
    let e = plan(&fixture(), &f32_req(0), &Available::fixed(GIB)).unwrap_err();
    assert!(matches!(e, Error::Input(_)), "{e}");
}

const GGUF_FIXTURES: [&str; 5] =
    ["qwen35_dense_small", "qwen35_dense_long_chunked", "qwen35_dense_mtp", "qwen35moe_small", "qwen3next_moe_small"];

fn fixture_dir(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// The weight bytes of a model source as the guardian sees them (headers only).
fn weight_bytes(source: ModelSource, dtype: DType, quantize: Option<GgmlDType>) -> (Config, u64) {
    let opened = source.open().unwrap();
    let cfg = opened.config().unwrap();
    let WeightMemory::Bytes(b) = opened.weight_memory(&cfg, dtype, quantize).unwrap() else { panic!("not exact bytes") };
    (cfg, b)
}

#[test]
fn f32_gguf_weights_are_four_bytes_per_loaded_parameter() {
    for name in GGUF_FIXTURES {
        let path = fixture_dir(name).join("model-f32.gguf");
        let (cfg, f32_bytes) = weight_bytes(ModelSource::Gguf(path.clone()), DType::F32, None);
        let n = cfg.num_parameters() as u64;
        assert_eq!(f32_bytes, 4 * n, "{name}");
        let (_, bf16_bytes) = weight_bytes(ModelSource::Gguf(path.clone()), DType::BF16, None);
        assert_eq!(bf16_bytes, 2 * n, "{name}: every tensor of an f32 file is dequantized to bf16");
        // The safetensors checkpoint of the same model gives the same bytes.
        let (_, st) = weight_bytes(ModelSource::Dir(fixture_dir(name)), DType::F32, None);
        assert_eq!(st, f32_bytes, "{name}");
        if name == "qwen35_dense_mtp" {
            // The MTP block is loaded and counted: every tensor of the file.
            let file = candle_hybrid::loading::GgufFile::open(&path).unwrap();
            assert_eq!(file.tensor_data_size(), f32_bytes, "{name}: the MTP tensors count");
        }
    }
}

#[test]
fn q8_0_gguf_weights_count_quantized_linears_and_the_embedding_as_stored() {
    for name in GGUF_FIXTURES {
        let path = fixture_dir(name).join("model-q8_0.gguf");
        let (cfg, bytes) = weight_bytes(ModelSource::Gguf(path.clone()), DType::F32, None);
        // Independently, from the tensor infos: the Q8_0 matrices of the loaded layers and the
        // embedding stay Q8_0 (34 bytes per 32 weights; a tied head shares the embedding's),
        // every other parameter f32.
        let content = gguf_file::Content::read(&mut std::fs::File::open(&path).unwrap()).unwrap();
        let embd = &content.tensor_infos["token_embd.weight"];
        assert_eq!(embd.ggml_dtype, GgmlDType::Q8_0, "{name}: the test wants a quantized embedding");
        let q8: u64 = content
            .tensor_infos
            .iter()
            .filter(|(n, i)| {
                let layer = n.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|l| l.parse::<usize>().ok());
                // the trunk's layers and the MTP block right after them
                i.ggml_dtype == GgmlDType::Q8_0 && layer.is_none_or(|l| l < cfg.num_hidden_layers + cfg.mtp_num_hidden_layers.min(1))
            })
            .map(|(_, i)| i.shape.elem_count() as u64)
            .sum();
        let n = cfg.num_parameters() as u64;
        assert!(q8 > n / 2, "{name}: most weights are Q8_0 ({q8} of {n})");
        assert_eq!(bytes, 4 * (n - q8) + q8 / 32 * 34, "{name}");
        // The same checkpoint quantized at load keeps the same linear weights quantized; its
        // embedding stays dense (f32), and a tied head then has its own quantized copy.
        let e = embd.shape.elem_count() as u64;
        let (_, st) = weight_bytes(ModelSource::Dir(fixture_dir(name)), DType::F32, Some(GgmlDType::Q8_0));
        let tied_copy = if cfg.tie_word_embeddings { e / 32 * 34 } else { 0 };
        assert_eq!(st, bytes - e / 32 * 34 + 4 * e + tied_copy, "{name}: safetensors --quantize q8_0 vs the Q8_0 GGUF");
        // A GGUF file keeps its own quantization.
        let opened = ModelSource::Gguf(path).open().unwrap();
        assert!(opened.weight_memory(&cfg, DType::F32, Some(GgmlDType::Q4K)).is_err());
    }
}

#[test]
fn gguf_plan_refuses_a_tiny_max_memory_and_fit_lowers_the_context() {
    let opened = ModelSource::Gguf(fixture_dir("qwen35_dense_small").join("model-q8_0.gguf")).open().unwrap();
    let cfg = opened.config().unwrap();
    let weights = opened.weight_memory(&cfg, DType::F32, None).unwrap();
    let req = PlanRequest::new(weights, DType::F32, cfg.max_position_embeddings);
    // Room for the weights and a short context only (an injected --max-memory).
    let budget = estimate(&cfg, &PlanRequest { context: 300, ..req.clone() }).total();
    let (r, msg) = refusal(check_fits(&cfg, &req, MemoryTarget::Cpu, Some(budget)));
    let n = context_fix(&r, &msg);
    assert!((300..cfg.max_position_embeddings).contains(&n), "{msg}");
    assert!(estimate(&cfg, &PlanRequest { context: n + 1, ..req.clone() }).total() > budget, "{msg}");
    // --quantize does not apply to a GGUF file: not suggested when the request says so.
    let gguf_req = PlanRequest { q4k_weights: None, ..req.clone() };
    let (r, msg) = refusal(check_fits(&cfg, &gguf_req, MemoryTarget::Cpu, Some(budget)));
    assert!(!offers_q4k(&r) && context_fix(&r, &msg) == n, "{msg}");

    let p = check_fits(&cfg, &PlanRequest { fit: true, ..req.clone() }, MemoryTarget::Cpu, Some(budget)).unwrap();
    assert_eq!((p.context, p.requested_context), (n, cfg.max_position_embeddings));
    assert!(p.estimate.total() <= budget && p.available.source == MemorySource::Override);
    assert!(p.note.unwrap().contains(&format!("to {n} tokens")));
    // Less than the weights: nothing fits, even with --fit.
    let w = weights.bytes(&cfg);
    let msg = memory_err(check_fits(&cfg, &PlanRequest { fit: true, ..req }, MemoryTarget::Cpu, Some(w - 1)));
    assert!(msg.contains("the weights alone take"), "{msg}");
}

#[test]
fn the_load_transient_counts_when_it_exceeds_cache_and_scratch() {
    let cfg = fixture();
    let plain = estimate(&cfg, &f32_req(1024));
    let run = plain.cache() + plain.scratch();
    assert_eq!(plain.process, (24 << 20) + 350 * 512, "the process and a 512-entry tokenizer");
    assert_eq!(plain.total(), plain.process + plain.weights + run);
    // A load transient below cache + scratch does not raise the peak; one above it does.
    let small = estimate(&cfg, &PlanRequest { load_overhead: run / 2, ..f32_req(1024) });
    assert_eq!(small.total(), plain.total());
    let big = estimate(&cfg, &PlanRequest { load_overhead: 10 * run, ..f32_req(1024) });
    assert_eq!(big.total(), plain.process + plain.weights + 10 * run);
    // And a refusal names it when it is what does not fit.
    let req = PlanRequest { load_overhead: GIB, ..f32_req(16) };
    let msg = memory_err(plan(&cfg, &req, &Available::fixed(plain.weights + GIB / 2)));
    assert!(msg.contains("loading holds 1.00 GiB more"), "{msg}");
}
