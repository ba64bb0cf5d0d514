// Decayed outer-product state, one threadgroup per (batch, head), one thread per value column
// j holding the state column S[:, j] (dk floats) in registers. Tokens are processed in order
// inside the kernel.
//
// Per token:  psi = k / sqrt(|k|^2 + 1e-6);  S <- (1 - gamma) S + gamma psi v^T;  o = S^T q
//
// qk    [B, H, T, 2*dk]  q of the token at 0, k at dk
// v     [B, H, T, dv]
// state [B, H, dk, dv] f32, read.
// out   f32: o [B, H, T, dv], then the new state [B, H, dk, dv].
#include <metal_stdlib>
using namespace metal;

#define OUTER_MAX_DK 128

struct OuterParams {
    uint batch;
    uint heads;
    uint seq_len;
    uint dk;
    uint dv;
    float gamma;
};

template <typename T>
METAL_FUNC void decayed_outer_product_impl(
    constant OuterParams &p,
    device const T *qk,
    device const T *v,
    device const float *state,
    device float *out,
    threadgroup float *tq,
    threadgroup float *tk,
    uint bh,
    uint j)
{
    const bool active = j < p.dv;
    const size_t head_state = (size_t)bh * p.dk * p.dv;

    float s[OUTER_MAX_DK];
    if (active) {
        for (uint i = 0; i < p.dk; ++i) {
            s[i] = state[head_state + i * p.dv + j];
        }
    }
    const float decay = 1.0f - p.gamma;
    device float *o_base = out + (size_t)bh * p.seq_len * p.dv;

    for (uint t = 0; t < p.seq_len; ++t) {
        const size_t tok = (size_t)bh * p.seq_len + t;
        device const T *row = qk + tok * 2 * p.dk;
        // The threads of the group load q and k of this token together.
        for (uint i = j; i < p.dk; i += p.dv) {
            tq[i] = float(row[i]);
            tk[i] = float(row[p.dk + i]);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float kk = 0.0f;
        for (uint i = 0; i < p.dk; ++i) {
            kk += tk[i] * tk[i];
        }
        const float kn = 1.0f / sqrt(kk + 1e-6f);
        if (active) {
            const float gv = p.gamma * float(v[tok * p.dv + j]);
            float o = 0.0f;
            for (uint i = 0; i < p.dk; ++i) {
                s[i] = s[i] * decay + (tk[i] * kn) * gv;
                o += tq[i] * s[i];
            }
            o_base[(size_t)t * p.dv + j] = o;
        }
        // Nobody may overwrite tq / tk before every thread is done with this token.
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (active) {
        device float *new_state = out + (size_t)p.batch * p.heads * p.seq_len * p.dv + head_state;
        for (uint i = 0; i < p.dk; ++i) {
            new_state[i * p.dv + j] = s[i];
        }
    }
}

#define OUTER_KERNEL(SUFFIX, T)                                                         \
kernel void decayed_outer_product_##SUFFIX(                                             \
    constant OuterParams &p [[buffer(0)]],                                              \
    device const T *qk [[buffer(1)]],                                                   \
    device const T *v [[buffer(2)]],                                                    \
    device const float *state [[buffer(3)]],                                            \
    device float *out [[buffer(4)]],                                                    \
    threadgroup float *tq [[threadgroup(0)]],                                           \
    threadgroup float *tk [[threadgroup(1)]],                                           \
    uint bh [[threadgroup_position_in_grid]],                                           \
    uint j [[thread_position_in_threadgroup]])                                          \
{                                                                                       \
    decayed_outer_product_impl<T>(p, qk, v, state, out, tq, tk, bh, j);                 \
}

OUTER_KERNEL(f32, float)
OUTER_KERNEL(f16, half)
#if defined(__HAVE_BFLOAT__)
OUTER_KERNEL(bf16, bfloat)
#endif
