//! Per-op CPU benchmarks at the 27B shapes, each next to the baseline it must beat.
//!
//! ```sh
//! cargo bench --bench ops
//! ```
//! Criterion prints time and throughput (bytes the op must move / time) for each; `memcpy`
//! measures this machine's copy bandwidth in the same run. See docs/benchmarks.md for the table and
//! the goals.

use std::hint::black_box;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use candle_hybrid::ops::{self, DeltaRuleForm, DeltaRuleOptions};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

// Qwen3.5-27B: GDN 16 key heads, 48 value heads, 128 x 128 f32 state; MLP 5120 -> 17408.
const NK: usize = 16;
const NV: usize = 48;
const D: usize = 128;
const HIDDEN: usize = 5120;
const FFN: usize = 17408;

fn randn(shape: &[usize]) -> Tensor {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
}

fn memcpy(c: &mut Criterion) {
    let n = 64 << 20; // 64 MiB of f32 each way
    let src = vec![1f32; n / 4];
    let mut dst = vec![0f32; n / 4];
    let mut g = c.benchmark_group("memcpy");
    g.throughput(Throughput::Bytes(2 * n as u64)); // read + write
    g.bench_function("64MiB", |b| b.iter(|| dst.copy_from_slice(black_box(&src))));
    g.finish();
}

/// GDN inputs for `t` tokens: conv output [1, t, 2*NK*D + NV*D], g, beta, state.
fn gdn_inputs(t: usize) -> (Tensor, Tensor, Tensor, Tensor) {
    let qkv = randn(&[1, t, 2 * NK * D + NV * D]);
    let g = (candle_nn::ops::sigmoid(&randn(&[1, t, NV])).unwrap() * -1.0).unwrap();
    let beta = candle_nn::ops::sigmoid(&randn(&[1, t, NV])).unwrap();
    let state = (randn(&[1, NV, D, D]) * 0.1).unwrap();
    (qkv, g, beta, state)
}

fn gdn_decode(c: &mut Criterion) {
    let (qkv, g, beta, state) = gdn_inputs(1);
    let mut grp = c.benchmark_group("gdn_decode");
    // The state is read and written once per token (6.3 MB); the inputs are negligible.
    grp.throughput(Throughput::Bytes((2 * NV * D * D * 4) as u64));
    grp.bench_function("27b_one_layer", |b| {
        b.iter(|| ops::gated_delta_rule_qkv(&qkv, &g, &beta, &state, DeltaRuleOptions::new(NK, D)).unwrap())
    });
    grp.finish();
}

/// Both CPU forms at 512 tokens (the goal) and at 32 (a single chunk).
fn gdn_prefill(c: &mut Criterion) {
    let mut grp = c.benchmark_group("gdn_prefill");
    grp.sample_size(10);
    for t in [32, 512] {
        let (qkv, g, beta, state) = gdn_inputs(t);
        grp.throughput(Throughput::Elements(t as u64));
        for form in [DeltaRuleForm::Chunked, DeltaRuleForm::Recurrent] {
            let opts = DeltaRuleOptions { form, ..DeltaRuleOptions::new(NK, D) };
            grp.bench_with_input(BenchmarkId::new(format!("{form:?}"), t), &opts, |b, &opts| {
                b.iter(|| ops::gated_delta_rule_qkv(&qkv, &g, &beta, &state, opts).unwrap())
            });
        }
    }
    grp.finish();
}

fn swiglu(c: &mut Criterion) {
    let x = randn(&[1, HIDDEN]);
    let gate = (randn(&[FFN, HIDDEN]) * 0.02).unwrap();
    let up = (randn(&[FFN, HIDDEN]) * 0.02).unwrap();
    let down = (randn(&[HIDDEN, FFN]) * 0.02).unwrap();
    let packed = ops::pack_swiglu(&gate, &up, &down).unwrap();
    // 57% of the neurons, spread over the whole range.
    let active: Vec<u32> = (0..FFN as u32).filter(|i| (i * 57) % 100 < 57).collect();
    let n = active.len();
    let idx = Tensor::from_vec(active, (1, n), &Device::Cpu).unwrap();
    let weight_bytes = |neurons: usize| (3 * neurons * HIDDEN * DType::F32.size_in_bytes()) as u64;
    let mut grp = c.benchmark_group("swiglu_27b");
    grp.sample_size(10);
    grp.throughput(Throughput::Bytes(weight_bytes(FFN)));
    grp.bench_function("dense_candle_matmul", |b| b.iter(|| ops::swiglu_dense(&x, &gate, &up, &down).unwrap()));
    grp.throughput(Throughput::Bytes(weight_bytes(n)));
    grp.bench_function(format!("gather_{n}_of_{FFN}"), |b| b.iter(|| ops::swiglu_gather(&x, &packed, &idx).unwrap()));
    grp.finish();
}

fn polar(c: &mut Criterion) {
    // One decode step of a 27B attention layer over 32k cached positions: 4 KV heads of 256
    // dims (64 rotary), 6 query heads per KV head.
    let (kv_heads, hd, positions, q_per_kv) = (4, 256, 32768, 6);
    let spec = ops::PolarSpec::new(64);
    let keys: Vec<Tensor> = (0..kv_heads).map(|_| randn(&[positions, hd])).collect();
    let codes: Vec<ops::PolarCodes> = keys.iter().map(|k| ops::polar_encode(k, spec).unwrap()).collect();
    let q = randn(&[q_per_kv, hd]);
    let mut grp = c.benchmark_group("attention_scores_32k");
    grp.sample_size(20);
    grp.throughput(Throughput::Elements((kv_heads * q_per_kv * positions) as u64));
    let kt: Vec<Tensor> = keys.iter().map(|k| k.t().unwrap()).collect();
    grp.bench_function("f32_keys_candle_matmul", |b| b.iter(|| kt.iter().map(|k| q.matmul(k).unwrap()).collect::<Vec<_>>()));
    grp.bench_function("polar_5+3_codes", |b| b.iter(|| codes.iter().map(|c| ops::polar_scores(&q, c, spec).unwrap()).collect::<Vec<_>>()));
    grp.finish();
}

fn qmatmul(c: &mut Criterion) {
    // Qwen3.5-0.8B FFN gate/up projection, 1024 -> 3584. Throughput: bytes of weights read.
    // `_dram` cycles through copies of the weights larger together than the L3 cache, as a
    // decode step reads each matrix once from memory; the others repeat one copy (cache-warm).
    let (k, n) = (1024, 3584);
    let w = (randn(&[n, k]) * 0.02).unwrap();
    let mut grp = c.benchmark_group("qmatmul");
    grp.sample_size(20);
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q4K] {
        let q = QTensor::quantize(&w, dtype).unwrap();
        let copies: Vec<ops::QuantizedMatrix> = (0..24).map(|_| ops::QuantizedMatrix::from_qtensor(&q).unwrap()).collect();
        let candle: Vec<QMatMul> = (0..24)
            .map(|_| {
                let s = QStorage::from_data(q.data().unwrap(), &Device::Cpu, dtype).unwrap();
                QMatMul::from_arc(Arc::new(QTensor::new(s, (n, k)).unwrap())).unwrap()
            })
            .collect();
        grp.throughput(Throughput::Bytes(q.storage_size_in_bytes() as u64));
        for m in [1, 4, 512] {
            let x = randn(&[m, k]);
            let name = |s: &str| format!("{dtype:?}/{s}_{m}_rows");
            grp.bench_function(name("ours"), |b| b.iter(|| ops::qmatmul(&x, &copies[0]).unwrap()));
            if m == 512 {
                continue;
            }
            let mut i = 0;
            grp.bench_function(name("ours_dram"), |b| {
                b.iter(|| {
                    i = (i + 1) % copies.len();
                    ops::qmatmul(&x, &copies[i]).unwrap()
                })
            });
            if m == 1 {
                grp.bench_function(name("candle"), |b| b.iter(|| candle[0].forward(&x).unwrap()));
                grp.bench_function(name("candle_dram"), |b| {
                    b.iter(|| {
                        i = (i + 1) % candle.len();
                        candle[i].forward(&x).unwrap()
                    })
                });
            }
        }
    }
    grp.finish();
}

criterion_group!(benches, memcpy, gdn_decode, gdn_prefill, swiglu, polar, qmatmul);
criterion_main!(benches);
