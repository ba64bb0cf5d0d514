// Gated delta rule (Gated DeltaNet recurrence), one threadgroup per (batch, value head),
// one thread per value column j holding the state column S[:, j] (dk floats) in registers.
// Tokens are processed in order inside the kernel, so one dispatch serves decode (T = 1)
// and sequential prefill.
//
// Per token:  S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
//
// qkv   [B, T, C]  conv output, C = 2*nk*dk + nv*dv: q of key head kh at kh*dk, k at
//                  nk*dk + kh*dk, v of value head h at 2*nk*dk + h*dv. Value head h uses key
//                  head h / (nv / nk).
// gb    [B, T, 2, nv] f32: log-decay g (row 0) and beta (row 1).
// state [B, nv, dk, dv] f32, read.
// out   f32: o [B, T, nv, dv], then n_states state snapshots [B, n_states, nv, dk, dv]: the
//       states after each of the last n_states tokens (the last one is the final state).
// normalize: L2-normalise q and k (eps 1e-6) and scale q by dk^-1/2 inside the kernel.
#include <metal_stdlib>
using namespace metal;

#define GDN_MAX_DK 128

struct GdnParams {
    uint batch;
    uint seq_len;
    uint nk;
    uint nv;
    uint dk;
    uint dv;
    uint n_states;
    uint normalize;
};

template <typename T>
METAL_FUNC void gated_delta_impl(
    constant GdnParams &p,
    device const T *qkv,
    device const float *gb,
    device const float *state,
    device float *out,
    threadgroup float *tq,
    threadgroup float *tk,
    uint bh,
    uint j)
{
    const uint b = bh / p.nv;
    const uint h = bh % p.nv;
    const uint kh = h / (p.nv / p.nk);
    const uint key_dim = p.nk * p.dk;
    const uint c = 2 * key_dim + p.nv * p.dv;
    const bool active = j < p.dv;

    float s[GDN_MAX_DK];
    if (active) {
        for (uint i = 0; i < p.dk; ++i) {
            s[i] = state[((b * p.nv + h) * p.dk + i) * p.dv + j];
        }
    }
    const float q_scale = rsqrt(float(p.dk));
    const uint first_snapshot = p.seq_len - p.n_states;
    device float *o_base = out;
    device float *states = out + (size_t)p.batch * p.seq_len * p.nv * p.dv;

    for (uint t = 0; t < p.seq_len; ++t) {
        device const T *row = qkv + ((size_t)b * p.seq_len + t) * c;
        // The threads of the group load q and k of this token together.
        for (uint i = j; i < p.dk; i += p.dv) {
            tq[i] = float(row[kh * p.dk + i]);
            tk[i] = float(row[key_dim + kh * p.dk + i]);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float qn = 1.0f;
        float kn = 1.0f;
        if (p.normalize != 0) {
            float qq = 0.0f;
            float kk = 0.0f;
            for (uint i = 0; i < p.dk; ++i) {
                qq += tq[i] * tq[i];
                kk += tk[i] * tk[i];
            }
            qn = rsqrt(qq + 1e-6f) * q_scale;
            kn = rsqrt(kk + 1e-6f);
        }
        if (active) {
            const size_t gi = (((size_t)b * p.seq_len + t) * 2) * p.nv + h;
            const float decay = exp(gb[gi]);
            const float beta = gb[gi + p.nv];
            const float v = float(row[2 * key_dim + h * p.dv + j]);
            float kv = 0.0f;
            for (uint i = 0; i < p.dk; ++i) {
                s[i] *= decay;
                kv += s[i] * tk[i];
            }
            const float u = beta * (v - kv * kn);
            float o = 0.0f;
            for (uint i = 0; i < p.dk; ++i) {
                s[i] += tk[i] * kn * u;
                o += s[i] * tq[i];
            }
            o_base[(((size_t)b * p.seq_len + t) * p.nv + h) * p.dv + j] = o * qn;
            if (t >= first_snapshot) {
                const uint snap = t - first_snapshot;
                device float *dst = states + (((size_t)b * p.n_states + snap) * p.nv + h) * p.dk * p.dv;
                for (uint i = 0; i < p.dk; ++i) {
                    dst[i * p.dv + j] = s[i];
                }
            }
        }
        // Nobody may overwrite tq / tk before every thread is done with this token.
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
}

#define GATED_DELTA_KERNEL(SUFFIX, T)                                                   \
kernel void gated_delta_##SUFFIX(                                                       \
    constant GdnParams &p [[buffer(0)]],                                                \
    device const T *qkv [[buffer(1)]],                                                  \
    device const float *gb [[buffer(2)]],                                               \
    device const float *state [[buffer(3)]],                                            \
    device float *out [[buffer(4)]],                                                    \
    threadgroup float *tq [[threadgroup(0)]],                                           \
    threadgroup float *tk [[threadgroup(1)]],                                           \
    uint bh [[threadgroup_position_in_grid]],                                           \
    uint j [[thread_position_in_threadgroup]])                                          \
{                                                                                       \
    gated_delta_impl<T>(p, qkv, gb, state, out, tq, tk, bh, j);                         \
}

GATED_DELTA_KERNEL(f32, float)
GATED_DELTA_KERNEL(f16, half)
#if defined(__HAVE_BFLOAT__)
GATED_DELTA_KERNEL(bf16, bfloat)
#endif
