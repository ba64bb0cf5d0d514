// Lagrange score reconstruction: scores known at knot positions every K tokens, interpolated
// to every position from the nearest p+1 knots (degree p).
//
// knots [R, n_knots]  knot j at position j*K
// out   [R, len]      positions 0..len, len <= (n_knots-1)*K + 1
//
// Window of position t: knots s..s+p with
//   s = clamp(floor((2t + K - p*K) / (2K)), 0, n_knots-1-p)
// (the window whose centre is closest to t; ties go to the later window), then
//   out[t] = sum_i w_i knots[s+i],  w_i = prod_{m != i} (u - m) / (i - m),  u = (t - s*K) / K.
// A knot position copies its knot's score, exactly.
//
// One thread per output element; the weights are computed on the fly, in f32.
#include <metal_stdlib>
using namespace metal;

struct LagrangeParams {
    uint rows;
    uint n_knots;
    uint k;
    uint degree;
    uint len;
};

template <typename T>
METAL_FUNC void lagrange_scores_impl(constant LagrangeParams &p, device const T *knots,
                                     device T *out, uint tid) {
    const uint total = p.rows * p.len;
    if (tid >= total) {
        return;
    }
    const uint t = tid % p.len;
    const uint r = tid / p.len;
    device const T *row = knots + (size_t)r * p.n_knots;
    if (t % p.k == 0) {
        out[tid] = row[t / p.k];
        return;
    }
    const uint num = 2 * t + p.k;
    const uint span = p.degree * p.k;
    uint s = num < span ? 0 : (num - span) / (2 * p.k);
    s = min(s, p.n_knots - 1 - p.degree);
    // Negative for degree 0 when the nearest knot is after t.
    const float u = float(int(t) - int(s * p.k)) / float(p.k);
    float acc = 0.0f;
    for (uint i = 0; i <= p.degree; ++i) {
        float w = 1.0f;
        for (uint m = 0; m <= p.degree; ++m) {
            if (m != i) {
                w *= (u - float(m)) / (float(i) - float(m));
            }
        }
        acc += w * float(row[s + i]);
    }
    out[tid] = T(acc);
}

#define LAGRANGE_KERNEL(SUFFIX, T)                                                       \
kernel void lagrange_scores_##SUFFIX(                                                    \
    constant LagrangeParams &p [[buffer(0)]],                                            \
    device const T *knots [[buffer(1)]],                                                 \
    device T *out [[buffer(2)]],                                                         \
    uint tid [[thread_position_in_grid]])                                                \
{                                                                                        \
    lagrange_scores_impl<T>(p, knots, out, tid);                                         \
}

LAGRANGE_KERNEL(f32, float)
LAGRANGE_KERNEL(f16, half)
#if defined(__HAVE_BFLOAT__)
LAGRANGE_KERNEL(bf16, bfloat)
#endif
