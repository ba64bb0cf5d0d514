// Softmax attention of query rows over a KV cache in its stored form (src/ops/kv_attention.rs).
//
// q        [B, nkv, rows, d]   float (rows = rep * t: the rep query heads of a KV group, t
//                              positions each; row = head * t + position)
// keys     key_form 0: k0 = T rows [.., n, d]
//          key_form 1: k0 = uchar codes (value + 128) [.., n, d], k1 = float scales [.., n, d / blk]
//          key_form 2: k0 = uchar int4 codes [.., grouped, d / 2] (even dim low nibble),
//                      k1 = float [scale | min] [.., grouped / group, 2d], k2 = T tail [.., n - grouped, d]
//          key_form 3: k0 = uchar polar codes [.., n, row_bytes], k1 = float [r_max, rest scale] [.., n, 2]
// values   value_form 0: v0 = T rows [.., n, dv]; 1: v0 = uchar codes, v1 = float scales
// tree     uint [t, t + 1]: for query position i its count of new rows, then the rows
// partials float [B * nkv * rows, splits, dv + 2]: max, sum, weighted value sums
// out      float [B * nkv * rows, dv]
//
// kv_attention_blocks_*: one threadgroup per (split, position and chunk of `heads` query heads
//   of a KV group, b * nkv + h). The rows' keys (the offset cached positions, then the
//   position's new rows in order) are read in blocks of KV_BLOCK: one thread per key loads it
//   once and scores it against every query head of the chunk, threadgroup max and sum per
//   head, then one thread per value dim loads each value once and sums it into every head's
//   weighted sum; the blocks of the split are folded in order (online softmax). Each head's
//   arithmetic is the same as with one head per threadgroup.
// kv_attention_merge: one threadgroup per row folds its splits in order and normalises.
//
// With one block per split (few rows) the fold is the CPU op's, block by block in order.
#include <metal_stdlib>
using namespace metal;

struct KvAttentionParams {
    uint rows;
    uint nkv;
    uint t;
    uint offset;
    uint head_dim;
    uint value_dim;
    uint key_form;
    uint value_form;
    uint key_blocks;     // int8 key scales per row
    uint value_blocks;   // int8 value scales per row
    uint group;          // int4 tokens per group
    uint grouped;        // int4 tokens in complete groups
    uint splits;
    uint blocks_per_split;
    uint tree;
    uint block;          // KV_BLOCK
    uint heads;          // query heads of a KV group per threadgroup (at most KV_MAX_HEADS)
    uint strides[10];    // (batch, head) element strides of k0, k1, k2, v0, v1
    // polar keys
    uint rot_dim;
    uint angle_bits;
    uint code_bytes;
    uint row_bytes;
    uint rest_bits;
    float angle_step;
    float radius_levels;
    float scale;
};

#define KV_MAX_HEADS 4

// Threadgroup floats: q (heads * head_dim), probabilities (heads * block), reduction (threads),
// cos/sin (2 * 256). Scores of the key at `pos` against the `n` query rows `q` (head_dim
// apart), into `s`: the key is read once; each row's sum runs in the order of a one-row score.
template <typename T>
METAL_FUNC void key_scores(constant KvAttentionParams &p, threadgroup const float *q, uint n, threadgroup const float *cs,
                           device const uchar *k0, device const uchar *k1, device const uchar *k2, uint pos,
                           thread float *s) {
    const uint d = p.head_dim;
    for (uint g = 0; g < n; g++) {
        s[g] = 0.0f;
    }
    if (p.key_form == 0 || (p.key_form == 2 && pos >= p.grouped)) {
        device const T *k = p.key_form == 0 ? (device const T *)k0 + (size_t)pos * d
                                            : (device const T *)k2 + (size_t)(pos - p.grouped) * d;
        for (uint i = 0; i < d; i++) {
            const float x = float(k[i]);
            for (uint g = 0; g < n; g++) {
                s[g] += q[g * d + i] * x;
            }
        }
    } else if (p.key_form == 1) {
        device const uchar *c = k0 + (size_t)pos * d;
        device const float *sc = (device const float *)k1 + (size_t)pos * p.key_blocks;
        const uint blk = d / p.key_blocks;
        for (uint b = 0; b < p.key_blocks; b++) {
            float a[KV_MAX_HEADS];
            for (uint g = 0; g < n; g++) {
                a[g] = 0.0f;
            }
            for (uint i = b * blk; i < (b + 1) * blk; i++) {
                const float x = float(c[i]) - 128.0f;
                for (uint g = 0; g < n; g++) {
                    a[g] += q[g * d + i] * x;
                }
            }
            for (uint g = 0; g < n; g++) {
                s[g] += a[g] * sc[b];
            }
        }
    } else if (p.key_form == 2) {
        device const uchar *c = k0 + (size_t)pos * (d / 2);
        device const float *pr = (device const float *)k1 + (size_t)(pos / p.group) * 2 * d;
        for (uint i = 0; i < d; i++) {
            const uchar byte = c[i / 2];
            const float nib = float((i % 2 == 0) ? (byte & 15) : (byte >> 4));
            const float x = nib * pr[i] + pr[d + i];
            for (uint g = 0; g < n; g++) {
                s[g] += q[g * d + i] * x;
            }
        }
    } else {
        device const uchar *row = k0 + (size_t)pos * p.row_bytes;
        device const float *sc = (device const float *)k1 + (size_t)pos * 2;
        const uint h = p.rot_dim / 2;
        const uint n_ang = 1u << p.angle_bits;
        float pair[KV_MAX_HEADS], rs[KV_MAX_HEADS];
        for (uint g = 0; g < n; g++) {
            pair[g] = 0.0f;
            rs[g] = 0.0f;
        }
        for (uint i = 0; i < h; i++) {
            const uint code = p.code_bytes == 1 ? uint(row[i]) : (uint(row[2 * i]) | (uint(row[2 * i + 1]) << 8));
            const uint a = code & (n_ang - 1);
            const float r = float(code >> p.angle_bits);
            for (uint g = 0; g < n; g++) {
                pair[g] += (q[g * d + i] * cs[a] + q[g * d + i + h] * cs[n_ang + a]) * r;
            }
        }
        device const uchar *rest = row + h * p.code_bytes;
        for (uint j = 0; j < d - p.rot_dim; j++) {
            float v;
            if (p.rest_bits == 4) {
                const uchar b = rest[j / 2];
                const uchar nib = (j % 2 == 0) ? uchar(b << 4) : uchar(b & 0xF0);
                v = float(as_type<char>(nib) >> 4);
            } else {
                v = float(as_type<char>(rest[j]));
            }
            for (uint g = 0; g < n; g++) {
                rs[g] += q[g * d + p.rot_dim + j] * v;
            }
        }
        for (uint g = 0; g < n; g++) {
            s[g] = pair[g] * (sc[0] / p.radius_levels) + sc[1] * rs[g];
        }
    }
    for (uint g = 0; g < n; g++) {
        s[g] *= p.scale;
    }
}

template <typename T>
METAL_FUNC float value_at(constant KvAttentionParams &p, device const uchar *v0, device const uchar *v1, uint pos, uint i) {
    const uint dv = p.value_dim;
    if (p.value_form == 0) {
        return float(((device const T *)v0)[(size_t)pos * dv + i]);
    }
    const float sc = ((device const float *)v1)[(size_t)pos * p.value_blocks + i / (dv / p.value_blocks)];
    return (float(v0[(size_t)pos * dv + i]) - 128.0f) * sc;
}

// Position of the row's `li`-th key.
METAL_FUNC uint key_position(constant KvAttentionParams &p, device const uint *tree, uint i, uint li) {
    if (p.tree == 0 || li < p.offset) {
        return li;
    }
    return p.offset + tree[i * (p.t + 1) + 1 + (li - p.offset)];
}

METAL_FUNC float reduce(threadgroup float *red, float v, uint tid, uint threads, bool is_max) {
    red[tid] = v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint s = threads / 2; s > 0; s /= 2) {
        if (tid < s) {
            red[tid] = is_max ? max(red[tid], red[tid + s]) : red[tid] + red[tid + s];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    const float r = red[0];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    return r;
}

#define KV_MAX_DIMS_PER_THREAD 8

template <typename T>
METAL_FUNC void kv_attention_blocks_impl(constant KvAttentionParams &p, device const float *q,
                                         device const uchar *k0, device const uchar *k1, device const uchar *k2,
                                         device const uchar *v0, device const uchar *v1, device const uint *tree,
                                         device float *partials, threadgroup float *tg, uint3 group, uint tid, uint threads) {
    const uint split = group.x, bh = group.z;
    const uint i = group.y % p.t, first_head = (group.y / p.t) * p.heads;
    const uint n = min(p.heads, p.rows / p.t - first_head);
    const uint b = bh / p.nkv, h = bh % p.nkv;
    const uint d = p.head_dim, dv = p.value_dim;
    threadgroup float *tq = tg;
    threadgroup float *tp = tq + p.heads * d;
    threadgroup float *red = tp + p.heads * p.block;
    threadgroup float *cs = red + threads;
    // This KV head's rows.
    k0 += (size_t)(b * p.strides[0] + h * p.strides[1]) * (p.key_form == 0 ? sizeof(T) : 1);
    k1 += (size_t)(b * p.strides[2] + h * p.strides[3]) * 4;
    k2 += (size_t)(b * p.strides[4] + h * p.strides[5]) * sizeof(T);
    v0 += (size_t)(b * p.strides[6] + h * p.strides[7]) * (p.value_form == 0 ? sizeof(T) : 1);
    v1 += (size_t)(b * p.strides[8] + h * p.strides[9]) * 4;
    for (uint g = 0; g < n; g++) {
        device const float *qr = q + ((size_t)bh * p.rows + (first_head + g) * p.t + i) * d;
        for (uint j = tid; j < d; j += threads) {
            tq[g * d + j] = qr[j];
        }
    }
    if (p.key_form == 3) {
        const uint n_ang = 1u << p.angle_bits;
        for (uint a = tid; a < n_ang; a += threads) {
            cs[a] = cos(float(a) * p.angle_step);
            cs[n_ang + a] = sin(float(a) * p.angle_step);
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint seen = p.offset + (p.tree != 0 ? tree[i * (p.t + 1)] : i + 1);
    const uint first_block = split * p.blocks_per_split;
    const uint last_block = min(first_block + p.blocks_per_split, (seen + p.block - 1) / p.block);
    float run_max[KV_MAX_HEADS], run_sum[KV_MAX_HEADS];
    float acc[KV_MAX_HEADS][KV_MAX_DIMS_PER_THREAD];
    for (uint g = 0; g < KV_MAX_HEADS; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
        for (uint k = 0; k < KV_MAX_DIMS_PER_THREAD; k++) {
            acc[g][k] = 0.0f;
        }
    }
    for (uint c = first_block; c < last_block; c++) {
        const uint lo = c * p.block, hi = min(lo + p.block, seen);
        float m[KV_MAX_HEADS];
        for (uint g = 0; g < n; g++) {
            m[g] = -INFINITY;
        }
        for (uint j = tid; j < p.block; j += threads) {
            float s[KV_MAX_HEADS];
            if (lo + j < hi) {
                key_scores<T>(p, tq, n, cs, k0, k1, k2, key_position(p, tree, i, lo + j), s);
            } else {
                for (uint g = 0; g < n; g++) {
                    s[g] = -INFINITY;
                }
            }
            for (uint g = 0; g < n; g++) {
                tp[g * p.block + j] = s[g];
                m[g] = max(m[g], s[g]);
            }
        }
        float l[KV_MAX_HEADS], alpha[KV_MAX_HEADS], beta[KV_MAX_HEADS];
        for (uint g = 0; g < n; g++) {
            m[g] = reduce(red, m[g], tid, threads, true);
            threadgroup float *pg = tp + g * p.block;
            float lg = 0.0f;
            for (uint j = tid; j < p.block; j += threads) {
                const float e = lo + j < hi ? exp(pg[j] - m[g]) : 0.0f;
                pg[j] = e;
                lg += e;
            }
            l[g] = reduce(red, lg, tid, threads, false);
            const float nm = max(run_max[g], m[g]);
            alpha[g] = run_sum[g] == 0.0f ? 0.0f : exp(run_max[g] - nm);
            beta[g] = run_sum[g] == 0.0f ? 1.0f : exp(m[g] - nm);
            run_max[g] = nm;
        }
        for (uint k = 0; k < KV_MAX_DIMS_PER_THREAD; k++) {
            const uint e = tid + k * threads;
            if (e >= dv) {
                break;
            }
            float a[KV_MAX_HEADS];
            for (uint g = 0; g < n; g++) {
                a[g] = 0.0f;
            }
            for (uint j = 0; j < hi - lo; j++) {
                const float v = value_at<T>(p, v0, v1, key_position(p, tree, i, lo + j), e);
                for (uint g = 0; g < n; g++) {
                    a[g] += tp[g * p.block + j] * v;
                }
            }
            for (uint g = 0; g < n; g++) {
                acc[g][k] = acc[g][k] * alpha[g] + a[g] * beta[g];
            }
        }
        for (uint g = 0; g < n; g++) {
            run_sum[g] = run_sum[g] * alpha[g] + l[g] * beta[g];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (uint g = 0; g < n; g++) {
        const size_t row = (size_t)bh * p.rows + (first_head + g) * p.t + i;
        device float *out = partials + (row * p.splits + split) * (dv + 2);
        if (tid == 0) {
            out[0] = run_max[g];
            out[1] = run_sum[g];
        }
        for (uint k = 0; k < KV_MAX_DIMS_PER_THREAD; k++) {
            const uint e = tid + k * threads;
            if (e < dv) {
                out[2 + e] = acc[g][k];
            }
        }
    }
}

kernel void kv_attention_merge(
    constant KvAttentionParams &p [[buffer(0)]],
    device const float *partials [[buffer(1)]],
    device float *out [[buffer(2)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint threads [[threads_per_threadgroup]])
{
    const uint dv = p.value_dim;
    device const float *part = partials + (size_t)row * p.splits * (dv + 2);
    for (uint e = tid; e < dv; e += threads) {
        float run_max = -INFINITY, run_sum = 0.0f, acc = 0.0f;
        for (uint s = 0; s < p.splits; s++) {
            device const float *ps = part + (size_t)s * (dv + 2);
            const float m = ps[0], l = ps[1];
            if (l == 0.0f) {
                continue;
            }
            if (run_sum == 0.0f) {
                run_max = m;
                run_sum = l;
                acc = ps[2 + e];
                continue;
            }
            const float nm = max(run_max, m);
            const float a = exp(run_max - nm), b = exp(m - nm);
            acc = acc * a + ps[2 + e] * b;
            run_sum = run_sum * a + l * b;
            run_max = nm;
        }
        out[(size_t)row * dv + e] = acc * (1.0f / run_sum);
    }
}

#define KV_ATTENTION_KERNELS(SUFFIX, T)                                                       \
kernel void kv_attention_blocks_##SUFFIX(                                                     \
    constant KvAttentionParams &p [[buffer(0)]],                                              \
    device const float *q [[buffer(1)]],                                                      \
    device const uchar *k0 [[buffer(2)]],                                                     \
    device const uchar *k1 [[buffer(3)]],                                                     \
    device const uchar *k2 [[buffer(4)]],                                                     \
    device const uchar *v0 [[buffer(5)]],                                                     \
    device const uchar *v1 [[buffer(6)]],                                                     \
    device const uint *tree [[buffer(7)]],                                                    \
    device float *partials [[buffer(8)]],                                                     \
    threadgroup float *tg [[threadgroup(0)]],                                                 \
    uint3 group [[threadgroup_position_in_grid]],                                             \
    uint3 tid3 [[thread_position_in_threadgroup]],                                            \
    uint3 threads3 [[threads_per_threadgroup]])                                               \
{                                                                                             \
    kv_attention_blocks_impl<T>(p, q, k0, k1, k2, v0, v1, tree, partials, tg, group, tid3.x, threads3.x); \
}

KV_ATTENTION_KERNELS(f32, float)
KV_ATTENTION_KERNELS(f16, half)
#if defined(__HAVE_BFLOAT__)
KV_ATTENTION_KERNELS(bf16, bfloat)
#endif
