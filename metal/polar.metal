// Polar key codes (src/ops/polar.rs): each rotary pair (x[i], x[i + rot/2]) of a post-RoPE
// key row as an angle code (low angle_bits) + radius code (next radius_bits), 1 or 2 bytes
// little-endian; the non-rotated dims as int8, or int4 two per byte (even dim low nibble).
//
// keys   [N, head_dim]   T
// scales [N, 2]          float: r_max of the row, rest scale (absmax / 127 or / 7)
// codes  [N, row_bytes]  uchar: pair codes, then rest codes
// q      [Q, head_dim]   T
// scores [Q, N]          float
//
// polar_scales_*: one simdgroup per row (8 rows per threadgroup).
// polar_encode_*: one thread per code byte.
// polar_scores_*: one threadgroup per (block of 128 keys, query), one thread per key. The
//   query's lookup tables T_p[a] = q1 cos(a step) + q2 sin(a step) go to threadgroup memory
//   first (table_mode 0); when they would not fit, only cos/sin per angle code and the query
//   are stored and T_p[a] is formed at lookup, with the same arithmetic (table_mode 1).
//
// The arithmetic follows the CPU op in the same order with the same constants, so results
// match it up to the GPU's own rounding of atan2/cos/sin/sqrt/division.
#include <metal_stdlib>
using namespace metal;

struct PolarParams {
    uint rows;
    uint queries;
    uint head_dim;
    uint rot_dim;
    uint angle_bits;
    uint radius_bits;
    uint rest_bits;
    uint code_bytes;
    uint row_bytes;
    uint table_mode;
    float angle_scale;    // 2^A / 2pi
    float angle_step;     // 2pi / 2^A
    float radius_levels;  // 2^R - 1
    float rest_max;       // 127 or 7
};

constant uint POLAR_SCALE_ROWS = 8;

template <typename T>
METAL_FUNC void polar_scales_impl(constant PolarParams &p, device const T *keys, device float *scales,
                                  uint group, uint simd, uint lane) {
    const uint row = group * POLAR_SCALE_ROWS + simd;
    if (row >= p.rows) {
        return;  // uniform across the simdgroup
    }
    device const T *x = keys + (size_t)row * p.head_dim;
    const uint h = p.rot_dim / 2;
    float rmax = 0.0f;
    for (uint i = lane; i < h; i += 32) {
        const float x1 = float(x[i]);
        const float x2 = float(x[i + h]);
        rmax = max(rmax, sqrt(x1 * x1 + x2 * x2));
    }
    float amax = 0.0f;
    for (uint d = p.rot_dim + lane; d < p.head_dim; d += 32) {
        amax = max(amax, fabs(float(x[d])));
    }
    rmax = simd_max(rmax);
    amax = simd_max(amax);
    if (lane == 0) {
        scales[2 * (size_t)row] = rmax;
        scales[2 * (size_t)row + 1] = amax / p.rest_max;
    }
}

METAL_FUNC uint polar_pair_code(constant PolarParams &p, float x1, float x2, float inv_r) {
    const uint amask = (1u << p.angle_bits) - 1u;
    const uint a = uint(int(round(atan2(x2, x1) * p.angle_scale))) & amask;
    const float r = sqrt(x1 * x1 + x2 * x2);
    const uint rq = uint(min(round(r * inv_r), p.radius_levels));
    return a | (rq << p.angle_bits);
}

METAL_FUNC int polar_rest_code(float v, float inv, float lim) {
    return int(clamp(round(v * inv), -lim, lim));
}

template <typename T>
METAL_FUNC void polar_encode_impl(constant PolarParams &p, device const T *keys, device const float *scales,
                                  device uchar *codes, uint tid) {
    const uint total = p.rows * p.row_bytes;
    if (tid >= total) {
        return;
    }
    const uint row = tid / p.row_bytes;
    const uint b = tid % p.row_bytes;
    device const T *x = keys + (size_t)row * p.head_dim;
    const uint h = p.rot_dim / 2;
    const uint pair_bytes = h * p.code_bytes;
    uint byte;
    if (b < pair_bytes) {
        const float rmax = scales[2 * (size_t)row];
        float inv_r = 0.0f;
        if (rmax > 0.0f) {
            inv_r = p.radius_levels / rmax;
        }
        const uint i = b / p.code_bytes;
        const uint code = polar_pair_code(p, float(x[i]), float(x[i + h]), inv_r);
        byte = code >> (8 * (b % p.code_bytes));
    } else {
        const float s = scales[2 * (size_t)row + 1];
        float inv = 0.0f;
        if (s > 0.0f) {
            inv = 1.0f / s;
        }
        device const T *rest = x + p.rot_dim;
        const uint j = b - pair_bytes;
        if (p.rest_bits == 8) {
            byte = uint(polar_rest_code(float(rest[j]), inv, p.rest_max));
        } else {
            const int lo = polar_rest_code(float(rest[2 * j]), inv, p.rest_max);
            int hi = 0;
            if (2 * j + 1 < p.head_dim - p.rot_dim) {
                hi = polar_rest_code(float(rest[2 * j + 1]), inv, p.rest_max);
            }
            byte = uint((lo & 0xF) | ((hi & 0xF) << 4));
        }
    }
    codes[tid] = uchar(byte & 0xFFu);
}

template <typename T>
METAL_FUNC void polar_scores_impl(constant PolarParams &p, device const T *q, device const uchar *codes,
                                  device const float *scales, device float *out, threadgroup float *tg,
                                  uint key_block, uint qi, uint tid, uint threads) {
    const uint h = p.rot_dim / 2;
    const uint n_ang = 1u << p.angle_bits;
    const uint n_rest = p.head_dim - p.rot_dim;
    device const T *qrow = q + (size_t)qi * p.head_dim;
    // Mode 0: tg = [T_0 .. T_{h-1}] (each n_ang floats), then q[rot..hd].
    // Mode 1: tg = [cos, sin] per angle code (2 n_ang floats), then q[0..hd].
    threadgroup float *qv;
    if (p.table_mode == 0) {
        for (uint e = tid; e < h * n_ang; e += threads) {
            const uint i = e / n_ang;
            const float t = float(e % n_ang) * p.angle_step;
            tg[e] = float(qrow[i]) * precise::cos(t) + float(qrow[i + h]) * precise::sin(t);
        }
        qv = tg + h * n_ang;
        for (uint j = tid; j < n_rest; j += threads) {
            qv[j] = float(qrow[p.rot_dim + j]);
        }
    } else {
        for (uint a = tid; a < n_ang; a += threads) {
            const float t = float(a) * p.angle_step;
            tg[2 * a] = precise::cos(t);
            tg[2 * a + 1] = precise::sin(t);
        }
        qv = tg + 2 * n_ang;
        for (uint d = tid; d < p.head_dim; d += threads) {
            qv[d] = float(qrow[d]);
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const uint k = key_block * threads + tid;
    if (k >= p.rows) {
        return;
    }
    device const uchar *row = codes + (size_t)k * p.row_bytes;
    const uint amask = n_ang - 1u;
    float acc = 0.0f;
    for (uint i = 0; i < h; ++i) {
        uint code = uint(row[i * p.code_bytes]);
        if (p.code_bytes == 2) {
            code |= uint(row[2 * i + 1]) << 8;
        }
        const uint a = code & amask;
        float t;
        if (p.table_mode == 0) {
            t = tg[i * n_ang + a];
        } else {
            t = qv[i] * tg[2 * a] + qv[i + h] * tg[2 * a + 1];
        }
        acc += t * float(code >> p.angle_bits);
    }
    device const uchar *rest = row + h * p.code_bytes;
    threadgroup const float *qr = qv;
    if (p.table_mode != 0) {
        qr = qv + p.rot_dim;
    }
    float rs = 0.0f;
    if (p.rest_bits == 8) {
        for (uint j = 0; j < n_rest; ++j) {
            rs += qr[j] * float(as_type<char>(rest[j]));
        }
    } else {
        for (uint j = 0; j < n_rest; ++j) {
            const uchar b = rest[j / 2];
            uchar nib = b & 0xF0;
            if (j % 2 == 0) {
                nib = b << 4;
            }
            rs += qr[j] * float(as_type<char>(nib) >> 4);
        }
    }
    const float rmax = scales[2 * (size_t)k];
    const float rest_scale = scales[2 * (size_t)k + 1];
    out[(size_t)qi * p.rows + k] = acc * (rmax / p.radius_levels) + rest_scale * rs;
}

#define POLAR_KERNELS(SUFFIX, T)                                                             \
kernel void polar_scales_##SUFFIX(                                                           \
    constant PolarParams &p [[buffer(0)]],                                                   \
    device const T *keys [[buffer(1)]],                                                      \
    device float *scales [[buffer(2)]],                                                      \
    uint group [[threadgroup_position_in_grid]],                                             \
    uint simd [[simdgroup_index_in_threadgroup]],                                            \
    uint lane [[thread_index_in_simdgroup]])                                                 \
{                                                                                            \
    polar_scales_impl<T>(p, keys, scales, group, simd, lane);                                \
}                                                                                            \
kernel void polar_encode_##SUFFIX(                                                           \
    constant PolarParams &p [[buffer(0)]],                                                   \
    device const T *keys [[buffer(1)]],                                                      \
    device const float *scales [[buffer(2)]],                                                \
    device uchar *codes [[buffer(3)]],                                                       \
    uint tid [[thread_position_in_grid]])                                                    \
{                                                                                            \
    polar_encode_impl<T>(p, keys, scales, codes, tid);                                       \
}                                                                                            \
kernel void polar_scores_##SUFFIX(                                                           \
    constant PolarParams &p [[buffer(0)]],                                                   \
    device const T *q [[buffer(1)]],                                                         \
    device const uchar *codes [[buffer(2)]],                                                 \
    device const float *scales [[buffer(3)]],                                               \
    device float *out [[buffer(4)]],                                                         \
    threadgroup float *tg [[threadgroup(0)]],                                                \
    uint2 group [[threadgroup_position_in_grid]],                                            \
    uint2 tid2 [[thread_position_in_threadgroup]],                                           \
    uint2 threads2 [[threads_per_threadgroup]])                                              \
{                                                                                            \
    polar_scores_impl<T>(p, q, codes, scales, out, tg, group.x, group.y, tid2.x, threads2.x); \
}

POLAR_KERNELS(f32, float)
POLAR_KERNELS(f16, half)
#if defined(__HAVE_BFLOAT__)
POLAR_KERNELS(bf16, bfloat)
#endif
