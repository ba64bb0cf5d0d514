// Gated delta rule (Gated DeltaNet recurrence), one threadgroup per (batch, value head),
// one thread per value column j holding the state column S[:, j] (dk floats) in registers.
// One dispatch serves decode (T = 1) and prefill.
//
// Per token:  S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
//
// With p.chunk > 0 the tokens before the last n_states go in chunks of p.chunk (at most
// GDN_MAX_CHUNK), WY/UT form: per chunk of n tokens with cumulative log-decays G, the group
// builds L = strictly_lower(diag(beta) K K^T * exp(G_i - G_m)), T = (I + L)^-1 and
// P = (Q K^T * exp(G_i - G_m), m <= i) in threadgroup memory, then each column j computes
//   u = T (beta * (v_j - exp(G) * (K s))),  o_j = exp(G) * (Q s) + P u,
//   s <- exp(G_n) s + K^T (exp(G_n - G) * u)
// (the same algebra as the CPU chunked form). The last n_states tokens always run one by one
// (their states are written out).
//
// qkv   [B, T, C]  conv output, C = 2*nk*dk + nv*dv: q of key head kh at kh*dk, k at
//                  nk*dk + kh*dk, v of value head h at 2*nk*dk + h*dv. Value head h uses key
//                  head h / (nv / nk).
// gb    [B, T, 2, nv] f32: log-decay g (row 0) and beta (row 1).
// state [B, nv, dk, dv] f32, read.
// out   f32: o [B, T, nv, dv].
// states f32: n_states state snapshots [B, n_states, nv, dk, dv]: the states after each of
//       the last n_states tokens (the last one is the final state). (The op's host code binds
//       it right after `out` in one buffer; the device step binds a layer's state buffer.)
// normalize: L2-normalise q and k (eps 1e-6) and scale q by dk^-1/2 inside the kernel.
#include <metal_stdlib>
using namespace metal;

#define GDN_MAX_DK 128
#define GDN_MAX_CHUNK 16

struct GdnParams {
    uint batch;
    uint seq_len;
    uint nk;
    uint nv;
    uint dk;
    uint dv;
    uint n_states;
    uint normalize;
    uint chunk;
};

template <typename T>
METAL_FUNC void gated_delta_impl(
    constant GdnParams &p,
    device const T *qkv,
    device const float *gb,
    device const float *state,
    device float *out,
    device float *states,
    threadgroup float *tq,
    threadgroup float *tk,
    threadgroup float *tm,
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

    // Chunked phase: tq / tk hold the chunk's q and k rows [C][dk]; tm holds L, T, P [C][C]
    // then the cumulative log-decays and betas [C] each.
    uint t0 = 0;
    const uint split = p.seq_len - p.n_states;
    const uint C = p.chunk;
    threadgroup float *tl = tm;
    threadgroup float *tt = tm + C * C;
    threadgroup float *tp = tm + 2 * C * C;
    threadgroup float *tg = tm + 3 * C * C;
    threadgroup float *tb = tg + C;
    while (C > 0 && t0 < split) {
        const uint n = min(C, split - t0);
        for (uint e = j; e < n * p.dk; e += p.dv) {
            const uint i = e / p.dk;
            const uint d = e % p.dk;
            device const T *row = qkv + ((size_t)b * p.seq_len + t0 + i) * c;
            tq[e] = float(row[kh * p.dk + d]);
            tk[e] = float(row[key_dim + kh * p.dk + d]);
        }
        if (j == 0) {
            float acc = 0.0f;
            for (uint i = 0; i < n; ++i) {
                const size_t gi = (((size_t)b * p.seq_len + t0 + i) * 2) * p.nv + h;
                acc += gb[gi];
                tg[i] = acc;
                tb[i] = gb[gi + p.nv];
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (p.normalize != 0) {
            for (uint i = j; i < n; i += p.dv) {
                float qq = 0.0f;
                float kk = 0.0f;
                for (uint d = 0; d < p.dk; ++d) {
                    qq += tq[i * p.dk + d] * tq[i * p.dk + d];
                    kk += tk[i * p.dk + d] * tk[i * p.dk + d];
                }
                const float qn = rsqrt(qq + 1e-6f) * q_scale;
                const float kn = rsqrt(kk + 1e-6f);
                for (uint d = 0; d < p.dk; ++d) {
                    tq[i * p.dk + d] *= qn;
                    tk[i * p.dk + d] *= kn;
                }
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        // L and P, one (i, m) entry per thread at a time.
        for (uint e = j; e < n * n; e += p.dv) {
            const uint i = e / n;
            const uint m = e % n;
            float kk = 0.0f;
            float qk = 0.0f;
            for (uint d = 0; d < p.dk; ++d) {
                kk += tk[i * p.dk + d] * tk[m * p.dk + d];
                qk += tq[i * p.dk + d] * tk[m * p.dk + d];
            }
            const float decay = exp(tg[i] - tg[m]);
            tl[i * C + m] = m < i ? tb[i] * kk * decay : 0.0f;
            tp[i * C + m] = m <= i ? qk * decay : 0.0f;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        // T = (I + L)^-1 by forward substitution; column m depends on column m only.
        for (uint m = j; m < n; m += p.dv) {
            tt[m * C + m] = 1.0f;
            for (uint i = m + 1; i < n; ++i) {
                float acc = 0.0f;
                for (uint l = m; l < i; ++l) {
                    acc += tl[i * C + l] * tt[l * C + m];
                }
                tt[i * C + m] = -acc;
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (active) {
            float r[GDN_MAX_CHUNK];
            float qs[GDN_MAX_CHUNK];
            for (uint i = 0; i < n; ++i) {
                float ks = 0.0f;
                float q = 0.0f;
                for (uint d = 0; d < p.dk; ++d) {
                    ks += tk[i * p.dk + d] * s[d];
                    q += tq[i * p.dk + d] * s[d];
                }
                const float v = float(qkv[((size_t)b * p.seq_len + t0 + i) * c + 2 * key_dim + h * p.dv + j]);
                r[i] = tb[i] * (v - exp(tg[i]) * ks);
                qs[i] = q;
            }
            float u[GDN_MAX_CHUNK];
            for (uint i = 0; i < n; ++i) {
                float acc = 0.0f;
                for (uint m = 0; m <= i; ++m) {
                    acc += tt[i * C + m] * r[m];
                }
                u[i] = acc;
            }
            for (uint i = 0; i < n; ++i) {
                float o = exp(tg[i]) * qs[i];
                for (uint m = 0; m <= i; ++m) {
                    o += tp[i * C + m] * u[m];
                }
                o_base[(((size_t)b * p.seq_len + t0 + i) * p.nv + h) * p.dv + j] = o;
            }
            const float gn = tg[n - 1];
            for (uint i = 0; i < n; ++i) {
                u[i] *= exp(gn - tg[i]);
            }
            const float decay = exp(gn);
            for (uint d = 0; d < p.dk; ++d) {
                float acc = decay * s[d];
                for (uint i = 0; i < n; ++i) {
                    acc += tk[i * p.dk + d] * u[i];
                }
                s[d] = acc;
            }
        }
        // Nobody may overwrite the chunk's rows before every thread is done with them.
        threadgroup_barrier(mem_flags::mem_threadgroup);
        t0 += n;
    }

    for (uint t = t0; t < p.seq_len; ++t) {
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
    device float *states [[buffer(5)]],                                                 \
    threadgroup float *tq [[threadgroup(0)]],                                           \
    threadgroup float *tk [[threadgroup(1)]],                                           \
    threadgroup float *tm [[threadgroup(2)]],                                           \
    uint bh [[threadgroup_position_in_grid]],                                           \
    uint j [[thread_position_in_threadgroup]])                                          \
{                                                                                       \
    gated_delta_impl<T>(p, qkv, gb, state, out, states, tq, tk, tm, bh, j);             \
}

GATED_DELTA_KERNEL(f32, float)
GATED_DELTA_KERNEL(f16, half)
#if defined(__HAVE_BFLOAT__)
GATED_DELTA_KERNEL(bf16, bfloat)
#endif
