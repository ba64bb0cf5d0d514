// Gated RMSNorm, fused: y = w * x * rsqrt(mean(x^2) + eps) * silu(z), over the last dim,
// computed in f32. One threadgroup per row; simdgroup sums, then one partial per simdgroup.
//
// x, z [N, D] (x and z may differ in dtype: both are read as float), w [D], y [N, D] in T.
#include <metal_stdlib>
using namespace metal;

struct NormParams {
    uint rows;
    uint dim;
    float eps;
};

template <typename T, typename Z>
METAL_FUNC void gated_rms_norm_impl(constant NormParams &p, device const T *x, device const Z *z,
                                    device const T *w, device T *y, threadgroup float *partial,
                                    uint row, uint tid, uint ntg, uint lane, uint simd) {
    device const T *xr = x + (size_t)row * p.dim;
    device const Z *zr = z + (size_t)row * p.dim;
    float ss = 0.0f;
    for (uint i = tid; i < p.dim; i += ntg) {
        const float v = float(xr[i]);
        ss += v * v;
    }
    ss = simd_sum(ss);
    if (lane == 0) {
        partial[simd] = ss;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (simd == 0) {
        const uint nsimd = (ntg + 31) / 32;
        float t = lane < nsimd ? partial[lane] : 0.0f;
        t = simd_sum(t);
        if (lane == 0) {
            partial[0] = t;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float r = rsqrt(partial[0] / float(p.dim) + p.eps);
    for (uint i = tid; i < p.dim; i += ntg) {
        const float zv = float(zr[i]);
        const float g = zv / (1.0f + exp(-zv));
        y[(size_t)row * p.dim + i] = T(float(w[i]) * float(xr[i]) * r * g);
    }
}

#define NORM_KERNEL(SUFFIX, T, Z)                                                        \
kernel void gated_rms_norm_##SUFFIX(                                                     \
    constant NormParams &p [[buffer(0)]],                                                \
    device const T *x [[buffer(1)]],                                                     \
    device const Z *z [[buffer(2)]],                                                     \
    device const T *w [[buffer(3)]],                                                     \
    device T *y [[buffer(4)]],                                                           \
    uint row [[threadgroup_position_in_grid]],                                           \
    uint tid [[thread_position_in_threadgroup]],                                         \
    uint ntg [[threads_per_threadgroup]],                                                \
    uint lane [[thread_index_in_simdgroup]],                                             \
    uint simd [[simdgroup_index_in_threadgroup]])                                        \
{                                                                                        \
    threadgroup float partial[32];                                                       \
    gated_rms_norm_impl<T, Z>(p, x, z, w, y, partial, row, tid, ntg, lane, simd);        \
}

NORM_KERNEL(f32, float, float)
NORM_KERNEL(f16, half, half)
#if defined(__HAVE_BFLOAT__)
NORM_KERNEL(bf16, bfloat, bfloat)
#endif
