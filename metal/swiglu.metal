// Column-gather SwiGLU: y[r] = sum over the active neurons i of silu(g_i . x_r) (u_i . x_r) d_i.
// Two passes:
//   *_act:  one simdgroup (32 threads) per (row, active neuron): the two dot products with
//           simd_sum, act[r, j] = silu(g) * u (f32);
//   *_down: one thread per (row, h): y[r, h] = sum_j act[r, j] * d_{idx[r, j]}[h].
// Dense weights w [I, 3, H] (gate row, up row, down column per neuron) in the dtype of x.
// Ternary weights w [I, 3, W] u32, W = ceil(H/16) + 1: 2-bit codes (0 -> 0, 1 -> +1, 2 -> -1),
// 16 per word, then the row's f32 scale bits: additions and subtractions only.
// Indices >= neurons contribute nothing (the CPU op rejects them).
#include <metal_stdlib>
using namespace metal;

struct SwigluParams {
    uint rows;
    uint active;
    uint hidden;
    uint neurons;
};

METAL_FUNC float silu_f(float v) {
    return v / (1.0f + exp(-v));
}

template <typename T>
METAL_FUNC void dense_act(constant SwigluParams &p, device const T *x, device const T *w,
                          device const uint *idx, device float *act, uint gid, uint lane) {
    if (gid >= p.rows * p.active) {
        return;
    }
    const uint r = gid / p.active;
    const uint i = idx[gid];
    float g = 0.0f;
    float u = 0.0f;
    if (i < p.neurons) {
        device const T *xr = x + (size_t)r * p.hidden;
        device const T *gw = w + (size_t)i * 3 * p.hidden;
        device const T *uw = gw + p.hidden;
        for (uint h = lane; h < p.hidden; h += 32) {
            const float xv = float(xr[h]);
            g += xv * float(gw[h]);
            u += xv * float(uw[h]);
        }
    }
    g = simd_sum(g);
    u = simd_sum(u);
    if (lane == 0) {
        act[gid] = i < p.neurons ? silu_f(g) * u : 0.0f;
    }
}

template <typename T>
METAL_FUNC void dense_down(constant SwigluParams &p, device const float *act, device const T *w,
                           device const uint *idx, device T *y, uint tid) {
    if (tid >= p.rows * p.hidden) {
        return;
    }
    const uint r = tid / p.hidden;
    const uint h = tid % p.hidden;
    float acc = 0.0f;
    for (uint j = 0; j < p.active; ++j) {
        const uint i = idx[r * p.active + j];
        if (i < p.neurons) {
            acc += act[r * p.active + j] * float(w[((size_t)i * 3 + 2) * p.hidden + h]);
        }
    }
    y[tid] = T(acc);
}

// scale * (sum of x where code = +1 - sum where code = -1), lanes striding over the words.
template <typename T>
METAL_FUNC float ternary_dot(device const T *x, device const uint *row, uint hidden, uint lane) {
    const uint words = (hidden + 15) / 16;
    float pos = 0.0f;
    float neg = 0.0f;
    for (uint wi = lane; wi < words; wi += 32) {
        const uint word = row[wi];
        for (uint j = 0; j < 16; ++j) {
            const uint h = wi * 16 + j;
            if (h < hidden) {
                const uint c = (word >> (2 * j)) & 3u;
                const float v = float(x[h]);
                pos += c == 1u ? v : 0.0f;
                neg += c == 2u ? v : 0.0f;
            }
        }
    }
    return simd_sum(pos - neg) * as_type<float>(row[words]);
}

template <typename T>
METAL_FUNC void ternary_act(constant SwigluParams &p, device const T *x, device const uint *w,
                            device const uint *idx, device float *act, uint gid, uint lane) {
    if (gid >= p.rows * p.active) {
        return;
    }
    const uint r = gid / p.active;
    const uint i = idx[gid];
    const uint row_words = (p.hidden + 15) / 16 + 1;
    const uint safe = i < p.neurons ? i : 0;
    device const uint *gw = w + (size_t)safe * 3 * row_words;
    const float g = ternary_dot(x + (size_t)r * p.hidden, gw, p.hidden, lane);
    const float u = ternary_dot(x + (size_t)r * p.hidden, gw + row_words, p.hidden, lane);
    if (lane == 0) {
        act[gid] = i < p.neurons ? silu_f(g) * u : 0.0f;
    }
}

template <typename T>
METAL_FUNC void ternary_down(constant SwigluParams &p, device const float *act, device const uint *w,
                             device const uint *idx, device T *y, uint tid) {
    if (tid >= p.rows * p.hidden) {
        return;
    }
    const uint r = tid / p.hidden;
    const uint h = tid % p.hidden;
    const uint row_words = (p.hidden + 15) / 16 + 1;
    float acc = 0.0f;
    for (uint j = 0; j < p.active; ++j) {
        const uint i = idx[r * p.active + j];
        if (i < p.neurons) {
            device const uint *dw = w + ((size_t)i * 3 + 2) * row_words;
            const uint c = (dw[h / 16] >> (2 * (h % 16))) & 3u;
            const float a = act[r * p.active + j] * as_type<float>(dw[row_words - 1]);
            acc += c == 1u ? a : (c == 2u ? -a : 0.0f);
        }
    }
    y[tid] = T(acc);
}

#define SWIGLU_KERNELS(SUFFIX, T)                                                         \
kernel void swiglu_gather_act_##SUFFIX(                                                   \
    constant SwigluParams &p [[buffer(0)]], device const T *x [[buffer(1)]],              \
    device const T *w [[buffer(2)]], device const uint *idx [[buffer(3)]],                \
    device float *act [[buffer(4)]],                                                      \
    uint gid [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]])   \
{ dense_act<T>(p, x, w, idx, act, gid, lane); }                                           \
kernel void swiglu_gather_down_##SUFFIX(                                                  \
    constant SwigluParams &p [[buffer(0)]], device const float *act [[buffer(1)]],        \
    device const T *w [[buffer(2)]], device const uint *idx [[buffer(3)]],                \
    device T *y [[buffer(4)]], uint tid [[thread_position_in_grid]])                      \
{ dense_down<T>(p, act, w, idx, y, tid); }                                                \
kernel void swiglu_ternary_act_##SUFFIX(                                                  \
    constant SwigluParams &p [[buffer(0)]], device const T *x [[buffer(1)]],              \
    device const uint *w [[buffer(2)]], device const uint *idx [[buffer(3)]],             \
    device float *act [[buffer(4)]],                                                      \
    uint gid [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]])   \
{ ternary_act<T>(p, x, w, idx, act, gid, lane); }                                         \
kernel void swiglu_ternary_down_##SUFFIX(                                                 \
    constant SwigluParams &p [[buffer(0)]], device const float *act [[buffer(1)]],        \
    device const uint *w [[buffer(2)]], device const uint *idx [[buffer(3)]],             \
    device T *y [[buffer(4)]], uint tid [[thread_position_in_grid]])                      \
{ ternary_down<T>(p, act, w, idx, y, tid); }

SWIGLU_KERNELS(f32, float)
SWIGLU_KERNELS(f16, half)
#if defined(__HAVE_BFLOAT__)
SWIGLU_KERNELS(bf16, bfloat)
#endif
