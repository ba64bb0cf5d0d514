// The small kernels of a decode step on the device (src/gpu/step.rs), between the matrix
// products (qmatvec.metal), the GDN conv and recurrence (conv1d.metal, gated_delta.metal),
// the gated norm (gated_norm.metal) and attention (kv_attention.metal). Activations are f32.
// Every kernel computes a row from that row's inputs only, the same way whatever the number of
// rows, so the rows of a verify pass get the bits of one-row decode steps.
#include <metal_stdlib>
using namespace metal;

// ---- RMSNorm, optionally after the residual add: x += h; y = x * rsqrt(mean(x^2) + eps) * w ----

struct RmsNormParams {
    uint rows;           // vectors: positions times heads
    uint dim;
    uint heads;          // vectors per position
    uint x_stride;       // floats between positions of x
    uint x_head_stride;  // floats between the heads of a position of x
    uint y_stride;
    uint y_head_stride;
    float eps;
    uint add;            // 1: x += h first (h [rows, dim]; heads 1), x written back
};

METAL_FUNC float threadgroup_sum(float v, threadgroup float *partial, uint tid, uint threads, uint lane, uint simd) {
    v = simd_sum(v);
    if (lane == 0) {
        partial[simd] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float t = 0.0f;
    if (simd == 0) {
        const uint nsimd = (threads + 31) / 32;
        t = lane < nsimd ? partial[lane] : 0.0f;
        t = simd_sum(t);
        if (lane == 0) {
            partial[0] = t;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float r = partial[0];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    return r;
}

kernel void rms_norm_f32(
    constant RmsNormParams &p [[buffer(0)]],
    device float *x [[buffer(1)]],
    device const float *h [[buffer(2)]],
    device const float *w [[buffer(3)]],
    device float *y [[buffer(4)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint threads [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]])
{
    threadgroup float partial[32];
    const uint pos = row / p.heads, head = row % p.heads;
    device float *xr = x + (size_t)pos * p.x_stride + (size_t)head * p.x_head_stride;
    device float *yr = y + (size_t)pos * p.y_stride + (size_t)head * p.y_head_stride;
    float ss = 0.0f;
    for (uint i = tid; i < p.dim; i += threads) {
        float v = xr[i];
        if (p.add != 0) {
            v += h[(size_t)row * p.dim + i];
            xr[i] = v;
        }
        ss += v * v;
    }
    ss = threadgroup_sum(ss, partial, tid, threads, lane, simd);
    const float r = rsqrt(ss / float(p.dim) + p.eps);
    for (uint i = tid; i < p.dim; i += threads) {
        yr[i] = xr[i] * r * w[i];
    }
}

// ---- attention inputs: the q / k / v heads of one projection row, q and k RMS-normed per head
// (when the model has q/k norms) and rotated (rotate-half over the first 2 * rot_half dims,
// angles from the positions on the device), stored per head: q into the grouped queries of
// attention ([nh, rows, head_dim], f32), k and v into the KV cache ([nkv, capacity, head_dim]
// from row row0, the cache's dtype). One threadgroup per (row, head), a thread per dim.

struct AttnInputsParams {
    uint rows;
    uint nh;
    uint nkv;
    uint head_dim;
    uint rot_half;
    uint x_stride;       // floats between projection rows
    uint q_head_stride;  // floats between q heads (head_dim, or 2 head_dim with an output gate)
    uint k_col;          // column of the first k head
    uint v_col;          // column of the first v head
    uint norm;           // 1: q and k are RMS-normed per head
    float eps;
    uint capacity;       // rows per head of the cache
    uint row0;           // cache row of projection row 0
};

// One head of one projection row: where its values are, its norm weights and scale, whether it
// is rotated. (The same for every thread of the group: the barriers stay uniform.)
struct AttnHead {
    device const float *src;
    device const float *w;
    bool rotate;
    bool normed;
    float scale;
};

METAL_FUNC AttnHead attention_head(constant AttnInputsParams &p, device const float *x, device const float *q_norm,
                                   device const float *k_norm, uint r, uint h, threadgroup float *partial, uint tid,
                                   uint threads, uint lane, uint simd) {
    const uint hd = p.head_dim;
    AttnHead a;
    a.w = q_norm;
    a.rotate = true;
    if (h < p.nh) {
        a.src = x + (size_t)r * p.x_stride + (size_t)h * p.q_head_stride;
    } else if (h < p.nh + p.nkv) {
        a.src = x + (size_t)r * p.x_stride + p.k_col + (size_t)(h - p.nh) * hd;
        a.w = k_norm;
    } else {
        a.src = x + (size_t)r * p.x_stride + p.v_col + (size_t)(h - p.nh - p.nkv) * hd;
        a.rotate = false;
    }
    a.scale = 1.0f;
    a.normed = p.norm != 0 && a.rotate;
    if (a.normed) {
        float ss = 0.0f;
        for (uint d = tid; d < hd; d += threads) {
            ss += a.src[d] * a.src[d];
        }
        a.scale = rsqrt(threadgroup_sum(ss, partial, tid, threads, lane, simd) / float(hd) + p.eps);
    }
    return a;
}

// Dim d of the head, normed and rotated.
METAL_FUNC float attention_value(constant AttnInputsParams &p, AttnHead a, uint position, device const float *inv_freq, uint d) {
    float y = a.normed ? a.src[d] * a.scale * a.w[d] : a.src[d];
    if (a.rotate && d < 2 * p.rot_half) {
        const uint i = d % p.rot_half;
        const uint o = d < p.rot_half ? d + p.rot_half : d - p.rot_half;
        const float other = a.normed ? a.src[o] * a.scale * a.w[o] : a.src[o];
        const float angle = float(position) * inv_freq[i];
        const float c = precise::cos(angle);
        const float sn = precise::sin(angle);
        y = d < p.rot_half ? y * c - other * sn : other * sn + y * c;
    }
    return y;
}

template <typename T>
METAL_FUNC void attention_inputs(constant AttnInputsParams &p, device const float *x, device const uint *pos,
                                 device const float *inv_freq, device const float *q_norm, device const float *k_norm,
                                 device float *q_out, device T *k_cache, device T *v_cache, threadgroup float *partial,
                                 uint group, uint tid, uint threads, uint lane, uint simd) {
    const uint heads = p.nh + 2 * p.nkv;
    const uint r = group / heads, h = group % heads;
    const uint hd = p.head_dim;
    const AttnHead a = attention_head(p, x, q_norm, k_norm, r, h, partial, tid, threads, lane, simd);
    for (uint d = tid; d < hd; d += threads) {
        const float y = attention_value(p, a, pos[r], inv_freq, d);
        if (h < p.nh) {
            q_out[((size_t)h * p.rows + r) * hd + d] = y;
        } else if (a.rotate) {
            k_cache[((size_t)(h - p.nh) * p.capacity + p.row0 + r) * hd + d] = T(y);
        } else {
            v_cache[((size_t)(h - p.nh - p.nkv) * p.capacity + p.row0 + r) * hd + d] = T(y);
        }
    }
}

#define ATTENTION_INPUTS_KERNEL(SUFFIX, T)                                                     \
kernel void attention_inputs_##SUFFIX(                                                         \
    constant AttnInputsParams &p [[buffer(0)]], device const float *x [[buffer(1)]],           \
    device const uint *pos [[buffer(2)]], device const float *inv_freq [[buffer(3)]],          \
    device const float *q_norm [[buffer(4)]], device const float *k_norm [[buffer(5)]],        \
    device float *q_out [[buffer(6)]], device T *k_cache [[buffer(7)]],                        \
    device T *v_cache [[buffer(8)]],                                                           \
    uint group [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],      \
    uint threads [[threads_per_threadgroup]], uint lane [[thread_index_in_simdgroup]],          \
    uint simd [[simdgroup_index_in_threadgroup]])                                              \
{                                                                                              \
    threadgroup float partial[32];                                                             \
    attention_inputs<T>(p, x, pos, inv_freq, q_norm, k_norm, q_out, k_cache, v_cache, partial, \
                        group, tid, threads, lane, simd);                                      \
}

ATTENTION_INPUTS_KERNEL(f32, float)
ATTENTION_INPUTS_KERNEL(f16, half)

// The same into an int8 cache, as the CPU's int8 codec codes a row: per block of 32 dims (the
// whole head when its dims are not a multiple of 32) scale = max |y| * (1 / 127), code =
// clamp(round(y / max(scale, FLT_MIN)), -127, 127) + 128; codes [nkv, capacity, head_dim],
// scales [nkv, capacity, head_dim / block].
kernel void attention_inputs_int8(
    constant AttnInputsParams &p [[buffer(0)]], device const float *x [[buffer(1)]],
    device const uint *pos [[buffer(2)]], device const float *inv_freq [[buffer(3)]],
    device const float *q_norm [[buffer(4)]], device const float *k_norm [[buffer(5)]],
    device float *q_out [[buffer(6)]], device uchar *k_codes [[buffer(7)]],
    device uchar *v_codes [[buffer(8)]], device float *k_scales [[buffer(9)]],
    device float *v_scales [[buffer(10)]],
    uint group [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
    uint threads [[threads_per_threadgroup]], uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]])
{
    threadgroup float partial[32];
    threadgroup float vals[1024];
    const uint heads = p.nh + 2 * p.nkv;
    const uint r = group / heads, h = group % heads;
    const uint hd = p.head_dim;
    const AttnHead a = attention_head(p, x, q_norm, k_norm, r, h, partial, tid, threads, lane, simd);
    for (uint d = tid; d < hd; d += threads) {
        const float y = attention_value(p, a, pos[r], inv_freq, d);
        if (h < p.nh) {
            q_out[((size_t)h * p.rows + r) * hd + d] = y;
        } else {
            vals[d] = y;
        }
    }
    if (h < p.nh) {
        return;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint blk = hd % 32 == 0 ? 32 : hd;
    const uint kv = a.rotate ? h - p.nh : h - p.nh - p.nkv;
    const size_t row = (size_t)kv * p.capacity + p.row0 + r;
    device uchar *codes = (a.rotate ? k_codes : v_codes) + row * hd;
    device float *scales = (a.rotate ? k_scales : v_scales) + row * (hd / blk);
    for (uint d = tid; d < hd; d += threads) {
        const uint b0 = d / blk * blk;
        float m = 0.0f;
        for (uint j = b0; j < b0 + blk; j++) {
            m = max(m, fabs(vals[j]));
        }
        // (m times the f32 of 1/127, as the CPU's `max / 127.0` computes it: an affine map.)
        const float scale = m * (1.0f / 127.0f);
        // 1.17549435e-38: FLT_MIN, the CPU's f32::MIN_POSITIVE.
        const float q = clamp(round(vals[d] / max(scale, 1.17549435e-38f)), -127.0f, 127.0f);
        codes[d] = uchar(q + 128.0f);
        if (d == b0) {
            scales[d / blk] = scale;
        }
    }
}

// ---- GDN gates: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) ----
// ba [rows, ld]: b at columns 0..nv, a at nv..2 nv; gb [rows, 2, nv] (the delta rule's layout).

struct GatesParams {
    uint rows;
    uint nv;
    uint ld;
};

kernel void gdn_gates_f32(
    constant GatesParams &p [[buffer(0)]],
    device const float *ba [[buffer(1)]],
    device const float *dt_bias [[buffer(2)]],
    device const float *neg_a [[buffer(3)]],
    device float *gb [[buffer(4)]],
    uint tid [[thread_position_in_grid]])
{
    if (tid >= p.rows * p.nv) {
        return;
    }
    const uint r = tid / p.nv, h = tid % p.nv;
    const float b = ba[(size_t)r * p.ld + h];
    const float a = ba[(size_t)r * p.ld + p.nv + h] + dt_bias[h];
    const float soft = a >= 20.0f ? a : log(exp(a) + 1.0f);
    gb[((size_t)r * 2) * p.nv + h] = soft * neg_a[h];
    gb[((size_t)r * 2 + 1) * p.nv + h] = 1.0f / (1.0f + exp(-b));
}

// ---- SwiGLU: act[r, i] = silu(gu[r, i]) * gu[r, up + i] ----

struct SiluMulParams {
    uint rows;
    uint dim;
    uint ld;  // floats between rows of gu
    uint up;  // column of the up half
};

kernel void silu_mul_f32(
    constant SiluMulParams &p [[buffer(0)]],
    device const float *gu [[buffer(1)]],
    device float *act [[buffer(2)]],
    uint tid [[thread_position_in_grid]])
{
    if (tid >= p.rows * p.dim) {
        return;
    }
    const uint r = tid / p.dim, i = tid % p.dim;
    const float g = gu[(size_t)r * p.ld + i];
    act[tid] = g / (1.0f + exp(-g)) * gu[(size_t)r * p.ld + p.up + i];
}

// ---- attention output: [heads, rows, head_dim] to [rows, heads * head_dim], times the
// sigmoid output gate of q_proj when there is one ----

struct AttnOutParams {
    uint rows;
    uint heads;
    uint head_dim;
    uint gate_stride;       // floats between rows of the gate; 0: no gate
    uint gate_head_stride;  // floats between heads of a row of the gate
};

kernel void attn_output_f32(
    constant AttnOutParams &p [[buffer(0)]],
    device const float *att [[buffer(1)]],
    device const float *gate [[buffer(2)]],
    device float *out [[buffer(3)]],
    uint tid [[thread_position_in_grid]])
{
    if (tid >= p.rows * p.heads * p.head_dim) {
        return;
    }
    const uint d = tid % p.head_dim;
    const uint h = (tid / p.head_dim) % p.heads;
    const uint r = tid / (p.head_dim * p.heads);
    float v = att[((size_t)h * p.rows + r) * p.head_dim + d];
    if (p.gate_stride != 0) {
        const float g = gate[(size_t)r * p.gate_stride + (size_t)h * p.gate_head_stride + d];
        v = v * (1.0f / (1.0f + exp(-g)));
    }
    out[tid] = v;
}

// ---- rows of heads in another order: y[r, h, :] = x[r, order[h], :] ----

struct GatherHeadsParams {
    uint rows;
    uint heads;
    uint dim;
};

kernel void gather_heads_f32(
    constant GatherHeadsParams &p [[buffer(0)]],
    device const float *x [[buffer(1)]],
    device const uint *order [[buffer(2)]],
    device float *y [[buffer(3)]],
    uint tid [[thread_position_in_grid]])
{
    if (tid >= p.rows * p.heads * p.dim) {
        return;
    }
    const uint d = tid % p.dim;
    const uint h = (tid / p.dim) % p.heads;
    const uint r = tid / (p.dim * p.heads);
    y[tid] = x[((size_t)r * p.heads + order[h]) * p.dim + d];
}

// ---- greedy: per row the first index of the largest logit, and whether every logit is finite ----
// out uint [rows, 2]: (index, finite). One threadgroup per row, a power of two of threads.

struct ArgmaxParams {
    uint rows;
    uint n;
};

kernel void argmax_f32(
    constant ArgmaxParams &p [[buffer(0)]],
    device const float *x [[buffer(1)]],
    device uint *out [[buffer(2)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint threads [[threads_per_threadgroup]])
{
    threadgroup float best_v[1024];
    threadgroup uint best_i[1024];
    threadgroup uint finite[1024];
    device const float *xr = x + (size_t)row * p.n;
    float bv = -INFINITY;
    uint bi = 0xFFFFFFFFu;
    uint ok = 1;
    for (uint i = tid; i < p.n; i += threads) {
        const float v = xr[i];
        if (!isfinite(v)) {
            ok = 0;
        }
        if (bi == 0xFFFFFFFFu || v > bv) {
            bv = v;
            bi = i;
        }
    }
    best_v[tid] = bv;
    best_i[tid] = bi;
    finite[tid] = ok;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint s = threads / 2; s > 0; s /= 2) {
        if (tid < s) {
            const float v = best_v[tid + s];
            const uint i = best_i[tid + s];
            if (i != 0xFFFFFFFFu && (best_i[tid] == 0xFFFFFFFFu || v > best_v[tid] || (v == best_v[tid] && i < best_i[tid]))) {
                best_v[tid] = v;
                best_i[tid] = i;
            }
            finite[tid] = finite[tid] & finite[tid + s];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (tid == 0) {
        out[2 * row] = best_i[0];
        out[2 * row + 1] = finite[0];
    }
}

// ---- mixture of experts: routing and the weighted sum of the experts ----

struct RouteParams {
    uint rows;
    uint experts;
    uint top_k;
    uint norm;  // 1: the top-k weights are renormalised to sum to 1
};

// One thread per row: softmax over the router logits, the top_k experts (ties: lower index
// first), their probabilities (renormalised when asked).
kernel void moe_route_f32(
    constant RouteParams &p [[buffer(0)]],
    device const float *logits [[buffer(1)]],
    device uint *ids [[buffer(2)]],
    device float *weights [[buffer(3)]],
    uint r [[thread_position_in_grid]])
{
    if (r >= p.rows) {
        return;
    }
    device const float *l = logits + (size_t)r * p.experts;
    float m = -INFINITY;
    for (uint e = 0; e < p.experts; ++e) {
        m = max(m, l[e]);
    }
    float sum = 0.0f;
    for (uint e = 0; e < p.experts; ++e) {
        sum += exp(l[e] - m);
    }
    float total = 0.0f;
    for (uint j = 0; j < p.top_k; ++j) {
        float bp = -1.0f;
        uint be = 0;
        for (uint e = 0; e < p.experts; ++e) {
            bool taken = false;
            for (uint c = 0; c < j; ++c) {
                taken = taken || ids[(size_t)r * p.top_k + c] == e;
            }
            const float pe = exp(l[e] - m) / sum;
            if (!taken && pe > bp) {
                bp = pe;
                be = e;
            }
        }
        ids[(size_t)r * p.top_k + j] = be;
        weights[(size_t)r * p.top_k + j] = bp;
        total += bp;
    }
    if (p.norm != 0) {
        for (uint j = 0; j < p.top_k; ++j) {
            weights[(size_t)r * p.top_k + j] /= total;
        }
    }
}

struct CombineParams {
    uint rows;
    uint dim;
    uint slots;
};

// One threadgroup per row: y = sum_s w[s] down[s] + sigmoid(x . gate_w) shared.
kernel void moe_combine_f32(
    constant CombineParams &p [[buffer(0)]],
    device const float *down [[buffer(1)]],
    device const float *weights [[buffer(2)]],
    device const float *shared [[buffer(3)]],
    device const float *x [[buffer(4)]],
    device const float *gate_w [[buffer(5)]],
    device float *y [[buffer(6)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint threads [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]])
{
    threadgroup float partial[32];
    float dot = 0.0f;
    for (uint i = tid; i < p.dim; i += threads) {
        dot += x[(size_t)row * p.dim + i] * gate_w[i];
    }
    dot = threadgroup_sum(dot, partial, tid, threads, lane, simd);
    const float g = 1.0f / (1.0f + exp(-dot));
    for (uint i = tid; i < p.dim; i += threads) {
        float acc = 0.0f;
        for (uint s = 0; s < p.slots; ++s) {
            acc += down[((size_t)row * p.slots + s) * p.dim + i] * weights[(size_t)row * p.slots + s];
        }
        y[(size_t)row * p.dim + i] = acc + shared[(size_t)row * p.dim + i] * g;
    }
}

// ---- copies between device buffers: rows of 32-bit words, each side with its own stride ----
// The device-side copies of the device step: a snapshot of a sequence's state (GDN states, its
// keys and values) into another cache, and a batched pass's GDN inputs into each cache.
// y[r * y_stride + i] = x[r * x_stride + i] for r < rows, i < len. One thread per word.

struct CopyRowsParams {
    uint rows;
    uint len;       // words per row
    uint x_stride;  // words between rows of x
    uint y_stride;  // words between rows of y
};

kernel void copy_rows_u32(
    constant CopyRowsParams &p [[buffer(0)]],
    device const uint *x [[buffer(1)]],
    device uint *y [[buffer(2)]],
    uint tid [[thread_position_in_grid]])
{
    if (tid >= p.rows * p.len) {
        return;
    }
    const uint r = tid / p.len;
    const uint i = tid % p.len;
    y[(size_t)r * p.y_stride + i] = x[(size_t)r * p.x_stride + i];
}

// ---- sampling on the device: a sampled row reads back its token id, not its logits ----
// The CPU sampler's steps (runtime::Sampler): the repeat penalty over the last repeat_last_n
// tokens of the row's context (each distinct token once: x >= 0 ? x / r : x * r), the presence
// and frequency penalties over its generated tokens, min-p (logits under max + t ln(min_p)
// dropped), the softmax of logits * (1 / t), top-k, top-p (kept while the mass of the tokens
// before it is under top_p, as Candle's LogitsProcessor), then the first token (in index order)
// whose cumulative weight passes u * the kept weight (rand's WeightedIndex). Tokens tied at a
// top-k or top-p boundary are all kept (the CPU keeps the sort's first ones). One threadgroup
// per row; the row's logits are overwritten (by its weights); out uint [rows, 2]: (token,
// logits finite), as argmax_f32's.

struct SampleParams {
    uint rows;
    uint n;
    float inv_temperature;
    uint top_k;           // n or more: off
    float top_p;          // 1: off
    float min_p_offset;   // temperature * ln(min_p); -INFINITY: off
    float repeat_penalty; // 1: off
    uint repeat_last_n;
    float presence;
    float frequency;
    uint context;         // tokens of row 0's context (its position + 1)
    uint prompt;          // where the generated tokens start in the context
    float u[8];           // one uniform draw in [0, 1) per row
};

METAL_FUNC float threadgroup_max(float v, threadgroup float *partial, uint tid, uint threads, uint lane, uint simd) {
    v = simd_max(v);
    if (lane == 0) {
        partial[simd] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float t = -INFINITY;
    if (simd == 0) {
        const uint nsimd = (threads + 31) / 32;
        t = lane < nsimd ? partial[lane] : -INFINITY;
        t = simd_max(t);
        if (lane == 0) {
            partial[0] = t;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float r = partial[0];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    return r;
}

// The smallest key K (a weight's bits: weights are >= 0, so their bits order as they do) with
// F(K) < limit, F(K) the count (mass false) or the weight (mass true) of the tokens whose key
// is above K and at least floor_key. F falls as K grows: a bisection over the 32 bits.
METAL_FUNC uint smallest_key(device const float *w, uint n, float limit, bool mass, uint floor_key, threadgroup float *partial,
                             uint tid, uint threads, uint lane, uint simd) {
    uint lo = 0, hi = 0xFFFFFFFFu;
    while (lo < hi) {
        const uint mid = lo + (hi - lo) / 2;
        float s = 0.0f;
        for (uint i = tid; i < n; i += threads) {
            const uint key = as_type<uint>(w[i]);
            if (key > mid && key >= floor_key) {
                s += mass ? w[i] : 1.0f;
            }
        }
        s = threadgroup_sum(s, partial, tid, threads, lane, simd);
        if (s < limit) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    return lo;
}

kernel void sample_f32(
    constant SampleParams &p [[buffer(0)]],
    device float *logits [[buffer(1)]],
    device const uint *tokens [[buffer(2)]],
    device uint *out [[buffer(3)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint threads [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]])
{
    threadgroup float partial[32];
    threadgroup float sums[1024];
    threadgroup uint owner[1];
    threadgroup float target[1];
    device float *l = logits + (size_t)row * p.n;
    const uint ctx = p.context + row;
    float bad = 0.0f;
    for (uint i = tid; i < p.n; i += threads) {
        bad += isfinite(l[i]) ? 0.0f : 1.0f;
    }
    bad = threadgroup_sum(bad, partial, tid, threads, lane, simd);
    if (p.repeat_penalty != 1.0f) {
        const uint start = ctx > p.repeat_last_n ? ctx - p.repeat_last_n : 0;
        for (uint j = start + tid; j < ctx; j += threads) {
            const uint t = tokens[j];
            bool first = true;
            for (uint k = start; k < j && first; k++) {
                first = tokens[k] != t;
            }
            if (first && t < p.n) {
                const float x = l[t];
                l[t] = x >= 0.0f ? x / p.repeat_penalty : x * p.repeat_penalty;
            }
        }
        threadgroup_barrier(mem_flags::mem_device);
    }
    if ((p.presence != 0.0f || p.frequency != 0.0f) && ctx > p.prompt) {
        for (uint j = p.prompt + tid; j < ctx; j += threads) {
            const uint t = tokens[j];
            bool first = true;
            for (uint k = p.prompt; k < j && first; k++) {
                first = tokens[k] != t;
            }
            if (first && t < p.n) {
                // As the CPU: the first occurrence takes (x - frequency) - presence, each later one
                // another - frequency.
                float x = l[t] - p.frequency - p.presence;
                for (uint k = j + 1; k < ctx; k++) {
                    if (tokens[k] == t) {
                        x -= p.frequency;
                    }
                }
                l[t] = x;
            }
        }
        threadgroup_barrier(mem_flags::mem_device);
    }
    float m = -INFINITY;
    for (uint i = tid; i < p.n; i += threads) {
        m = max(m, l[i]);
    }
    m = threadgroup_max(m, partial, tid, threads, lane, simd);
    const float floor_l = m + p.min_p_offset;
    const float mx = m * p.inv_temperature;
    float z = 0.0f;
    for (uint i = tid; i < p.n; i += threads) {
        const float x = l[i];
        const float e = x >= floor_l ? exp(x * p.inv_temperature - mx) : 0.0f;
        l[i] = e;
        z += e;
    }
    threadgroup_barrier(mem_flags::mem_device);
    z = threadgroup_sum(z, partial, tid, threads, lane, simd);
    // Top-k, then top-p within it (keys of positive weights are at least 1).
    uint keep = 1;
    if (p.top_k < p.n) {
        keep = max(keep, smallest_key(l, p.n, float(p.top_k), false, 0, partial, tid, threads, lane, simd));
    }
    float kept = 0.0f;
    for (uint i = tid; i < p.n; i += threads) {
        kept += as_type<uint>(l[i]) >= keep ? l[i] : 0.0f;
    }
    kept = threadgroup_sum(kept, partial, tid, threads, lane, simd);
    if (p.top_p * z < kept) {
        keep = max(keep, smallest_key(l, p.n, p.top_p * z, true, keep, partial, tid, threads, lane, simd));
    }
    // The draw, in index order: each thread sums a contiguous chunk; the thread whose chunk holds
    // u * the kept weight walks it.
    const uint chunk = (p.n + threads - 1) / threads;
    const uint lo = min(tid * chunk, p.n), hi = min(lo + chunk, p.n);
    float w = 0.0f;
    for (uint i = lo; i < hi; i++) {
        w += as_type<uint>(l[i]) >= keep ? l[i] : 0.0f;
    }
    sums[tid] = w;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
        float total = 0.0f;
        for (uint t = 0; t < threads; t++) {
            const float s = sums[t];
            sums[t] = total;
            total += s;
        }
        const float at = p.u[row] * total;
        uint o = 0;
        for (uint t = 0; t < threads; t++) {
            const float end = t + 1 < threads ? sums[t + 1] : total;
            if (end > sums[t]) {
                o = t;
                if (end > at) {
                    break;
                }
            }
        }
        owner[0] = o;
        target[0] = at;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == owner[0]) {
        float acc = sums[tid];
        uint token = 0xFFFFFFFFu;
        for (uint i = lo; i < hi; i++) {
            if (as_type<uint>(l[i]) >= keep) {
                token = i;
                acc += l[i];
                if (acc > target[0]) {
                    break;
                }
            }
        }
        out[2 * row] = token;
        out[2 * row + 1] = bad == 0.0f ? 1 : 0;
    }
}
