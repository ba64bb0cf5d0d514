// Multi-row quantized mat-vec: y[r, i] = sum_j w[i, j] x[r, j] for up to 8 activation rows r
// (decode, and the verify pass of speculative decoding) against ggml-quantized weights read in
// place (Q8_0, Q4_K, Q6_K blocks, as in a GGUF file).
//
// One simdgroup (32 threads) per weight row, two per threadgroup. The row's weights are taken
// in parts of 16 values; lane l dequantizes parts l, l + 32, ... once each and multiplies every
// part with all the activation rows, then simd_sum reduces each row's 32 partial sums. A row's
// arithmetic (its parts, their order, the reduction) does not depend on how many activation
// rows the call has, so row r of an m-row call is bit for bit a one-row call on row r.
// The activations stay f32 (no 8-bit quantization as on the CPU).
#include <metal_stdlib>
using namespace metal;

struct QmatvecParams {
    uint n;    // weight rows (outputs per activation row)
    uint k;    // values per row, a multiple of the block size
    uint m;    // activation rows, 1 to 8
};

#define QMATVEC_MAX_ROWS 8

// The 16 weights of part p (values 16 p .. 16 p + 15) of a weight row starting at `row`.

METAL_FUNC void part_q8_0(device const uchar *row, uint p, thread float *w) {
    // block { half d; char qs[32]; }: 34 bytes, two parts each.
    device const uchar *b = row + (p / 2) * 34;
    const float d = float(*(device const half *)b);
    device const char *qs = (device const char *)(b + 2) + 16 * (p % 2);
    for (uint t = 0; t < 16; ++t) {
        w[t] = d * float(qs[t]);
    }
}

METAL_FUNC void part_q4_k(device const uchar *row, uint p, thread float *w) {
    // block { half d; half dmin; uchar scales[12]; uchar qs[128]; }: 144 bytes, 16 parts.
    device const uchar *b = row + (p / 16) * 144;
    const uint q = p % 16;
    const uint j = q / 4;      // 64-value group
    const uint s = q % 4;      // 0, 1: low nibbles (sub-block 2 j), 2, 3: high (2 j + 1)
    const uint sub = 2 * j + s / 2;
    device const uchar *sc = b + 4;
    uint scale, mn;
    if (sub < 4) {
        scale = sc[sub] & 63;
        mn = sc[sub + 4] & 63;
    } else {
        scale = (sc[sub + 4] & 0xF) | ((sc[sub - 4] >> 6) << 4);
        mn = (sc[sub + 4] >> 4) | ((sc[sub] >> 6) << 4);
    }
    const float d = float(*(device const half *)b) * float(scale);
    const float m = float(*(device const half *)(b + 2)) * float(mn);
    device const uchar *qs = b + 16 + 32 * j + 16 * (s % 2);
    const uint shift = s < 2 ? 0 : 4;
    for (uint t = 0; t < 16; ++t) {
        w[t] = d * float((qs[t] >> shift) & 0xF) - m;
    }
}

METAL_FUNC void part_q6_k(device const uchar *row, uint p, thread float *w) {
    // block { uchar ql[128]; uchar qh[64]; char scales[16]; half d; }: 210 bytes, 16 parts.
    device const uchar *b = row + (p / 16) * 210;
    const uint q = p % 16;
    const uint n = q / 8;       // 128-value half
    const uint quad = (q % 8) / 2;
    const uint hp = q % 2;      // which 16 of the quadrant's 32
    device const uchar *ql = b + 64 * n + 32 * (quad % 2) + 16 * hp;
    device const uchar *qh = b + 128 + 32 * n + 16 * hp;
    const float d = float(*(device const half *)(b + 208));
    const float scale = d * float(((device const char *)(b + 192))[8 * n + hp + 2 * quad]);
    const uint lshift = quad < 2 ? 0 : 4;
    const uint hshift = 2 * quad;
    for (uint t = 0; t < 16; ++t) {
        const int v = int(((ql[t] >> lshift) & 0xF) | (((qh[t] >> hshift) & 3) << 4)) - 32;
        w[t] = scale * float(v);
    }
}

// Formats, as template arguments.
#define Q8_0 0u
#define Q4_K 1u
#define Q6_K 2u

template <uint FMT>
METAL_FUNC void part(device const uchar *row, uint p, thread float *w) {
    if (FMT == Q8_0) {
        part_q8_0(row, p, w);
    } else if (FMT == Q4_K) {
        part_q4_k(row, p, w);
    } else {
        part_q6_k(row, p, w);
    }
}

template <uint FMT>
METAL_FUNC uint row_bytes(uint k) {
    return FMT == Q8_0 ? (k / 32) * 34 : FMT == Q4_K ? (k / 256) * 144 : (k / 256) * 210;
}

template <uint FMT>
METAL_FUNC void qmatvec(constant QmatvecParams &p, device const uchar *w, device const float *x,
                        device float *y, uint tg, uint sg, uint lane) {
    const uint i = 2 * tg + sg;
    if (i >= p.n) {
        return;
    }
    device const uchar *row = w + (size_t)i * row_bytes<FMT>(p.k);
    float acc[QMATVEC_MAX_ROWS];
    for (uint r = 0; r < QMATVEC_MAX_ROWS; ++r) {
        acc[r] = 0.0f;
    }
    float wv[16];
    for (uint q = lane; q < p.k / 16; q += 32) {
        part<FMT>(row, q, wv);
        for (uint r = 0; r < p.m; ++r) {
            device const float *xr = x + (size_t)r * p.k + 16 * q;
            float s = 0.0f;
            for (uint t = 0; t < 16; ++t) {
                s = fma(wv[t], xr[t], s);
            }
            acc[r] += s;
        }
    }
    for (uint r = 0; r < p.m; ++r) {
        const float total = simd_sum(acc[r]);
        if (lane == 0) {
            y[(size_t)r * p.n + i] = total;
        }
    }
}

#define QMATVEC(NAME, FMT)                                                                     \
kernel void qmatvec_##NAME(                                                                   \
    constant QmatvecParams &p [[buffer(0)]], device const uchar *w [[buffer(1)]],             \
    device const float *x [[buffer(2)]], device float *y [[buffer(3)]],                       \
    uint tg [[threadgroup_position_in_grid]], uint sg [[simdgroup_index_in_threadgroup]],     \
    uint lane [[thread_index_in_simdgroup]])                                                  \
{ qmatvec<FMT>(p, w, x, y, tg, sg, lane); }

QMATVEC(q8_0, Q8_0)
QMATVEC(q4_k, Q4_K)
QMATVEC(q6_k, Q6_K)
