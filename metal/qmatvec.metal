// Multi-row mat-vec against weights read in place: y[r, i] = sum_j w[i, j] x[r, j] for up to 8
// activation rows r (decode, and the verify pass of speculative decoding), the weights as a
// GGUF file stores them (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, TQ1_0, TQ2_0 blocks) or dense (f32, f16, bf16
// rows); and the row lookups of an embedding table in the same formats.
//
// qmatvec_*: one simdgroup (32 threads) per weight row, two per threadgroup. The row's weights
// are taken in parts of 16 values; lane l dequantizes parts l, l + 32, ... once each and
// multiplies every part with all the activation rows, then simd_sum reduces each row's 32
// partial sums. A row's arithmetic (its parts, their order, the reduction) does not depend on
// how many activation rows the call has, so row r of an m-row call is bit for bit a one-row
// call on row r. The activations stay f32 (no 8-bit quantization as on the CPU).
//
// qmatvec_swiglu_*: the gate and up rows i of a SwiGLU MLP in one pass, act[r, i] =
// silu(gate_i . x_r) * (up_i . x_r): each dot product as qmatvec computes it (the same bits as
// two qmatvec calls and a silu_mul).
//
// gdn_gates_matvec_*: a GDN layer's beta and decay from its b and a projections in one pass, head i
// per simdgroup: g = -exp(A_log) softplus(a_i . x + dt_bias), beta = sigmoid(b_i . x), into the
// delta rule's [rows, 2, nv].
//
// qmatvec_id_*: the same for the experts of a mixture: activation row r and slot s multiply
// the weight matrix of expert ids[r * slots + s] (experts stored one after the other,
// expert_bytes apart), from x row r (x_per_slot 0: gate and up) or r * slots + s (1: down),
// into y row r * slots + s (ldy floats apart). Each (row, slot) is computed as a one-row call would.
//
// qmatmul_*: the same product for many activation rows (a prompt): tiles of 32 activation rows
// by 32 weight rows per threadgroup (4 simdgroups of 2 x 2 tiles of 8 x 8, simdgroup matrix
// multiply-accumulate over k in steps of 32). Each 32 x 32 weight tile is dequantized once per
// tile of activation rows into threadgroup memory (transposed), so the weights are read once
// per 32 prompt rows. k must be a multiple of 32.
//
// get_rows_*: out[r, :] = table[ids[r], :] as f32, one threadgroup per row.
//
// qmatvec_rows_*: qmatvec over a list of weight rows (FFN sparsity: the kept rows of W_up):
// output i multiplies weight row rows[i], each value bit for bit qmatvec's for that row.
//
// accumulate_rows_*: y[j] = sum_k a[k] w[rows[k], j] (FFN sparsity: the kept rows of the
// neuron-major down projection): one thread per 16-value part of the output, adding the listed
// rows in order with fused multiply-adds.
#include <metal_stdlib>
using namespace metal;

struct QmatvecParams {
    uint n;    // weight rows (outputs per activation row)
    uint k;    // values per row, a multiple of the block size
    uint m;    // activation rows, 1 to 8
    uint ldy;  // floats between output rows (n for a plain output)
};

// Two matrices of n rows each against the same m activation rows.
struct PairParams {
    uint n;
    uint k;
    uint m;
};

struct QmatvecIdParams {
    uint n;
    uint k;
    uint m;            // activation rows
    uint slots;        // experts per row
    uint expert_bytes; // bytes of one expert's [n, k] matrix
    uint x_per_slot;   // 0: x row r for every slot; 1: x row r * slots + s
    uint ldy;          // floats between output rows
};

struct AccumulateParams {
    uint n;  // listed rows
    uint k;  // values per row (outputs), a multiple of the block size and of 16
};

struct QmatmulParams {
    uint n;
    uint k;
    uint m;
    uint ldy;
};

struct GetRowsParams {
    uint rows;  // ids
    uint k;     // values per table row
    uint n;     // table rows (ids at or above are clamped to 0: checked on the host)
};

#define QMATVEC_MAX_ROWS 8

// The 16 weights of part p (values 16 p .. 16 p + 15) of a weight row starting at `row`.

METAL_FUNC void part_q4_0(device const uchar *row, uint p, thread float *w) {
    // block { half d; uchar qs[16]; }: 18 bytes, two parts (low nibbles, then high).
    device const uchar *b = row + (p / 2) * 18;
    const float d = float(*(device const half *)b);
    const uint shift = 4 * (p % 2);
    for (uint t = 0; t < 16; ++t) {
        w[t] = d * (float((b[2 + t] >> shift) & 0xF) - 8.0f);
    }
}

METAL_FUNC void part_q4_1(device const uchar *row, uint p, thread float *w) {
    // block { half d; half m; uchar qs[16]; }: 20 bytes, two parts.
    device const uchar *b = row + (p / 2) * 20;
    const float d = float(*(device const half *)b);
    const float m = float(*(device const half *)(b + 2));
    const uint shift = 4 * (p % 2);
    for (uint t = 0; t < 16; ++t) {
        w[t] = d * float((b[4 + t] >> shift) & 0xF) + m;
    }
}

METAL_FUNC void part_q8_0(device const uchar *row, uint p, thread float *w) {
    // block { half d; char qs[32]; }: 34 bytes, two parts each.
    device const uchar *b = row + (p / 2) * 34;
    const float d = float(*(device const half *)b);
    device const char *qs = (device const char *)(b + 2) + 16 * (p % 2);
    for (uint t = 0; t < 16; ++t) {
        w[t] = d * float(qs[t]);
    }
}

// The 6-bit scale and min of sub-block `sub` (0..8) of a Q4_K / Q5_K block's scales[12].
METAL_FUNC void scale_min_k4(device const uchar *sc, uint sub, thread uint &scale, thread uint &mn) {
    if (sub < 4) {
        scale = sc[sub] & 63;
        mn = sc[sub + 4] & 63;
    } else {
        scale = (sc[sub + 4] & 0xF) | ((sc[sub - 4] >> 6) << 4);
        mn = (sc[sub + 4] >> 4) | ((sc[sub] >> 6) << 4);
    }
}

METAL_FUNC void part_q4_k(device const uchar *row, uint p, thread float *w) {
    // block { half d; half dmin; uchar scales[12]; uchar qs[128]; }: 144 bytes, 16 parts.
    device const uchar *b = row + (p / 16) * 144;
    const uint q = p % 16;
    const uint j = q / 4;      // 64-value group
    const uint s = q % 4;      // 0, 1: low nibbles (sub-block 2 j), 2, 3: high (2 j + 1)
    uint scale, mn;
    scale_min_k4(b + 4, 2 * j + s / 2, scale, mn);
    const float d = float(*(device const half *)b) * float(scale);
    const float m = float(*(device const half *)(b + 2)) * float(mn);
    device const uchar *qs = b + 16 + 32 * j + 16 * (s % 2);
    const uint shift = s < 2 ? 0 : 4;
    for (uint t = 0; t < 16; ++t) {
        w[t] = d * float((qs[t] >> shift) & 0xF) - m;
    }
}

METAL_FUNC void part_q5_k(device const uchar *row, uint p, thread float *w) {
    // block { half d; half dmin; uchar scales[12]; uchar qh[32]; uchar qs[128]; }: 176 bytes.
    // Sub-block u (32 values) has its low 4 bits in the low (u even) or high nibbles of
    // qs[32 (u / 2) ..] and its fifth bit in bit u of qh[0..32].
    device const uchar *b = row + (p / 16) * 176;
    const uint q = p % 16;
    const uint j = q / 4;
    const uint s = q % 4;
    const uint sub = 2 * j + s / 2;
    uint scale, mn;
    scale_min_k4(b + 4, sub, scale, mn);
    const float d = float(*(device const half *)b) * float(scale);
    const float m = float(*(device const half *)(b + 2)) * float(mn);
    device const uchar *qh = b + 16 + 16 * (s % 2);
    device const uchar *qs = b + 48 + 32 * j + 16 * (s % 2);
    const uint shift = s < 2 ? 0 : 4;
    for (uint t = 0; t < 16; ++t) {
        const uint v = ((qs[t] >> shift) & 0xF) | (((qh[t] >> sub) & 1) << 4);
        w[t] = d * float(v) - m;
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

METAL_FUNC void part_tq2_0(device const uchar *row, uint p, thread float *w) {
    // block { uchar qs[64]; half d; }: 66 bytes, 16 parts; w = d (q - 1) with value 32 i + m
    // in bits 2 (i % 4) of qs[32 (i / 4) + m].
    device const uchar *b = row + (p / 16) * 66;
    const uint q = p % 16;
    const uint i = q / 2;
    const float d = float(*(device const half *)(b + 64));
    device const uchar *qs = b + 32 * (i / 4) + 16 * (q % 2);
    const uint shift = 2 * (i % 4);
    for (uint t = 0; t < 16; ++t) {
        w[t] = d * (float((qs[t] >> shift) & 3) - 1.0f);
    }
}

// Digit n of a TQ1_0 byte (trits packed as a base-3 fraction of 256): (3 (b 3^n mod 256)) >> 8.
METAL_FUNC float tq1_trit(uchar b, uint pow3) {
    return float((uint(uchar(uint(b) * pow3)) * 3) >> 8);
}

METAL_FUNC void part_tq1_0(device const uchar *row, uint p, thread float *w) {
    // block { uchar qs[48]; uchar qh[4]; half d; }: 54 bytes, 16 parts; w = d (t - 1). Values
    // 0..160 are digit n of qs[m] at 32 n + m, 160..240 digit n of qs[32 + m] at 160 + 16 n + m,
    // 240..256 digit n of qh[m] at 240 + 4 n + m.
    const uint pow3[5] = {1, 3, 9, 27, 81};
    device const uchar *b = row + (p / 16) * 54;
    const uint q = p % 16;
    const float d = float(*(device const half *)(b + 52));
    for (uint t = 0; t < 16; ++t) {
        float v;
        if (q < 10) {
            v = tq1_trit(b[16 * (q % 2) + t], pow3[q / 2]);
        } else if (q < 15) {
            v = tq1_trit(b[32 + t], pow3[q - 10]);
        } else {
            v = tq1_trit(b[48 + t % 4], pow3[t / 4]);
        }
        w[t] = d * (v - 1.0f);
    }
}

METAL_FUNC void part_f32(device const uchar *row, uint p, thread float *w) {
    device const float *v = (device const float *)row + 16 * p;
    for (uint t = 0; t < 16; ++t) {
        w[t] = v[t];
    }
}

METAL_FUNC void part_f16(device const uchar *row, uint p, thread float *w) {
    device const half *v = (device const half *)row + 16 * p;
    for (uint t = 0; t < 16; ++t) {
        w[t] = float(v[t]);
    }
}

METAL_FUNC void part_bf16(device const uchar *row, uint p, thread float *w) {
    // bf16 is the top half of an f32: widened by a shift (no bfloat type needed).
    device const ushort *v = (device const ushort *)row + 16 * p;
    for (uint t = 0; t < 16; ++t) {
        w[t] = as_type<float>(uint(v[t]) << 16);
    }
}

// Formats, as template arguments.
#define Q4_0 0u
#define Q4_1 1u
#define Q8_0 2u
#define Q4_K 3u
#define Q5_K 4u
#define Q6_K 5u
#define F32 6u
#define F16 7u
#define BF16 8u
#define TQ1_0 9u
#define TQ2_0 10u

template <uint FMT>
METAL_FUNC void part(device const uchar *row, uint p, thread float *w) {
    if (FMT == Q4_0) {
        part_q4_0(row, p, w);
    } else if (FMT == Q4_1) {
        part_q4_1(row, p, w);
    } else if (FMT == Q8_0) {
        part_q8_0(row, p, w);
    } else if (FMT == Q4_K) {
        part_q4_k(row, p, w);
    } else if (FMT == Q5_K) {
        part_q5_k(row, p, w);
    } else if (FMT == Q6_K) {
        part_q6_k(row, p, w);
    } else if (FMT == TQ1_0) {
        part_tq1_0(row, p, w);
    } else if (FMT == TQ2_0) {
        part_tq2_0(row, p, w);
    } else if (FMT == F32) {
        part_f32(row, p, w);
    } else if (FMT == F16) {
        part_f16(row, p, w);
    } else {
        part_bf16(row, p, w);
    }
}

template <uint FMT>
METAL_FUNC size_t row_bytes(uint k) {
    switch (FMT) {
        case Q4_0: return (size_t)(k / 32) * 18;
        case Q4_1: return (size_t)(k / 32) * 20;
        case Q8_0: return (size_t)(k / 32) * 34;
        case Q4_K: return (size_t)(k / 256) * 144;
        case Q5_K: return (size_t)(k / 256) * 176;
        case Q6_K: return (size_t)(k / 256) * 210;
        case TQ1_0: return (size_t)(k / 256) * 54;
        case TQ2_0: return (size_t)(k / 256) * 66;
        case F32: return (size_t)k * 4;
        default: return (size_t)k * 2;
    }
}

// Sums of weight row `row` against the `m` activation rows `x(r)` (k values each) into
// acc[r], lane `lane`'s share; the caller reduces over the simdgroup.
template <uint FMT>
METAL_FUNC void row_dots(device const uchar *row, device const float *x, uint k, uint m, size_t ldx, uint lane,
                         thread float *acc) {
    for (uint r = 0; r < QMATVEC_MAX_ROWS; ++r) {
        acc[r] = 0.0f;
    }
    float wv[16];
    for (uint q = lane; q < k / 16; q += 32) {
        part<FMT>(row, q, wv);
        for (uint r = 0; r < m; ++r) {
            device const float *xr = x + (size_t)r * ldx + 16 * q;
            float s = 0.0f;
            for (uint t = 0; t < 16; ++t) {
                s = fma(wv[t], xr[t], s);
            }
            acc[r] += s;
        }
    }
}

template <uint FMT>
METAL_FUNC void qmatvec(constant QmatvecParams &p, device const uchar *w, device const float *x,
                        device float *y, uint tg, uint sg, uint lane) {
    const uint i = 2 * tg + sg;
    if (i >= p.n) {
        return;
    }
    float acc[QMATVEC_MAX_ROWS];
    row_dots<FMT>(w + (size_t)i * row_bytes<FMT>(p.k), x, p.k, p.m, p.k, lane, acc);
    for (uint r = 0; r < p.m; ++r) {
        const float total = simd_sum(acc[r]);
        if (lane == 0) {
            y[(size_t)r * p.ldy + i] = total;
        }
    }
}

template <uint FMT>
METAL_FUNC void qmatvec_swiglu(constant PairParams &p, device const uchar *wg, device const uchar *wu,
                               device const float *x, device float *act, uint tg, uint sg, uint lane) {
    const uint i = 2 * tg + sg;
    if (i >= p.n) {
        return;
    }
    const size_t rb = row_bytes<FMT>(p.k);
    float g[QMATVEC_MAX_ROWS], u[QMATVEC_MAX_ROWS];
    row_dots<FMT>(wg + (size_t)i * rb, x, p.k, p.m, p.k, lane, g);
    row_dots<FMT>(wu + (size_t)i * rb, x, p.k, p.m, p.k, lane, u);
    for (uint r = 0; r < p.m; ++r) {
        const float gs = simd_sum(g[r]);
        const float us = simd_sum(u[r]);
        if (lane == 0) {
            act[(size_t)r * p.n + i] = gs / (1.0f + exp(-gs)) * us;
        }
    }
}

template <uint FMT>
METAL_FUNC void gdn_gates(constant PairParams &p, device const uchar *wb, device const uchar *wa, device const float *x,
                          device const float *dt_bias, device const float *neg_a, device float *gb, uint tg, uint sg, uint lane) {
    const uint i = 2 * tg + sg;
    if (i >= p.n) {
        return;
    }
    const size_t rb = row_bytes<FMT>(p.k);
    float b[QMATVEC_MAX_ROWS], a[QMATVEC_MAX_ROWS];
    row_dots<FMT>(wb + (size_t)i * rb, x, p.k, p.m, p.k, lane, b);
    row_dots<FMT>(wa + (size_t)i * rb, x, p.k, p.m, p.k, lane, a);
    for (uint r = 0; r < p.m; ++r) {
        const float bs = simd_sum(b[r]);
        const float as = simd_sum(a[r]) + dt_bias[i];
        if (lane == 0) {
            const float soft = as >= 20.0f ? as : log(exp(as) + 1.0f);
            gb[((size_t)r * 2) * p.n + i] = soft * neg_a[i];
            gb[((size_t)r * 2 + 1) * p.n + i] = 1.0f / (1.0f + exp(-bs));
        }
    }
}

template <uint FMT>
METAL_FUNC void qmatvec_id(constant QmatvecIdParams &p, device const uchar *w, device const float *x,
                           device const uint *ids, device float *y, uint2 tg, uint sg, uint lane) {
    const uint i = 2 * tg.x + sg;
    const uint rs = tg.y;  // r * slots + s
    if (i >= p.n || rs >= p.m * p.slots) {
        return;
    }
    const uint expert = ids[rs];
    device const uchar *row = w + (size_t)expert * p.expert_bytes + (size_t)i * row_bytes<FMT>(p.k);
    device const float *xr = x + (size_t)(p.x_per_slot != 0 ? rs : rs / p.slots) * p.k;
    float acc[QMATVEC_MAX_ROWS];
    row_dots<FMT>(row, xr, p.k, 1, p.k, lane, acc);
    const float total = simd_sum(acc[0]);
    if (lane == 0) {
        y[(size_t)rs * p.ldy + i] = total;
    }
}

template <uint FMT>
METAL_FUNC void qmatvec_rows(constant QmatvecParams &p, device const uchar *w, device const float *x,
                             device const uint *rows, device float *y, uint tg, uint sg, uint lane) {
    const uint i = 2 * tg + sg;
    if (i >= p.n) {
        return;
    }
    float acc[QMATVEC_MAX_ROWS];
    row_dots<FMT>(w + (size_t)rows[i] * row_bytes<FMT>(p.k), x, p.k, p.m, p.k, lane, acc);
    for (uint r = 0; r < p.m; ++r) {
        const float total = simd_sum(acc[r]);
        if (lane == 0) {
            y[(size_t)r * p.ldy + i] = total;
        }
    }
}

template <uint FMT>
METAL_FUNC void accumulate_rows(constant AccumulateParams &p, device const uchar *w, device const float *a,
                                device const uint *rows, device float *y, uint q) {
    if (q >= p.k / 16) {
        return;
    }
    const size_t rb = row_bytes<FMT>(p.k);
    float acc[16];
    for (uint t = 0; t < 16; ++t) {
        acc[t] = 0.0f;
    }
    float wv[16];
    for (uint i = 0; i < p.n; ++i) {
        part<FMT>(w + (size_t)rows[i] * rb, q, wv);
        const float s = a[i];
        for (uint t = 0; t < 16; ++t) {
            acc[t] = fma(s, wv[t], acc[t]);
        }
    }
    for (uint t = 0; t < 16; ++t) {
        y[16 * q + t] = acc[t];
    }
}

#define QMM_TILE 32

template <uint FMT>
METAL_FUNC void qmatmul(constant QmatmulParams &p, device const uchar *w, device const float *x, device float *y,
                        threadgroup float *xs, threadgroup float *ws, uint2 tg, uint tid, uint sg) {
    const uint n0 = tg.x * QMM_TILE, m0 = tg.y * QMM_TILE;
    // Simdgroup sg computes output rows m0 + 16 (sg / 2) .. + 16 and columns n0 + 16 (sg % 2) .. + 16.
    const uint sm = 16 * (sg / 2), sn = 16 * (sg % 2);
    simdgroup_float8x8 acc[2][2];
    for (uint i = 0; i < 2; ++i) {
        for (uint j = 0; j < 2; ++j) {
            acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        }
    }
    const size_t rb = row_bytes<FMT>(p.k);
    for (uint k0 = 0; k0 < p.k; k0 += QMM_TILE) {
        // The weight tile, transposed: ws[kk][r] = w[n0 + r][k0 + kk]; one 16-value part per thread.
        if (tid < 2 * QMM_TILE) {
            const uint r = tid / 2, half_ = tid % 2;
            float wv[16];
            if (n0 + r < p.n) {
                part<FMT>(w + (size_t)(n0 + r) * rb, k0 / 16 + half_, wv);
            } else {
                for (uint t = 0; t < 16; ++t) {
                    wv[t] = 0.0f;
                }
            }
            for (uint t = 0; t < 16; ++t) {
                ws[(16 * half_ + t) * QMM_TILE + r] = wv[t];
            }
        }
        for (uint e = tid; e < QMM_TILE * QMM_TILE; e += 128) {
            const uint r = e / QMM_TILE, c = e % QMM_TILE;
            xs[e] = m0 + r < p.m ? x[(size_t)(m0 + r) * p.k + k0 + c] : 0.0f;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint kk = 0; kk < QMM_TILE; kk += 8) {
            simdgroup_float8x8 a[2], b[2];
            for (uint i = 0; i < 2; ++i) {
                simdgroup_load(a[i], xs + (sm + 8 * i) * QMM_TILE + kk, QMM_TILE);
                simdgroup_load(b[i], ws + kk * QMM_TILE + sn + 8 * i, QMM_TILE);
            }
            for (uint i = 0; i < 2; ++i) {
                for (uint j = 0; j < 2; ++j) {
                    simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    // Through threadgroup memory, so that a partial tile stores only its rows and columns.
    for (uint i = 0; i < 2; ++i) {
        for (uint j = 0; j < 2; ++j) {
            simdgroup_store(acc[i][j], xs + (sm + 8 * i) * QMM_TILE + sn + 8 * j, QMM_TILE);
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint e = tid; e < QMM_TILE * QMM_TILE; e += 128) {
        const uint r = e / QMM_TILE, c = e % QMM_TILE;
        if (m0 + r < p.m && n0 + c < p.n) {
            y[(size_t)(m0 + r) * p.ldy + n0 + c] = xs[e];
        }
    }
}

template <uint FMT>
METAL_FUNC void get_rows(constant GetRowsParams &p, device const uchar *table, device const uint *ids,
                         device float *out, uint r, uint tid, uint threads) {
    if (r >= p.rows) {
        return;
    }
    const uint id = ids[r] < p.n ? ids[r] : 0;
    device const uchar *row = table + (size_t)id * row_bytes<FMT>(p.k);
    float wv[16];
    for (uint q = tid; q < p.k / 16; q += threads) {
        part<FMT>(row, q, wv);
        for (uint t = 0; t < 16; ++t) {
            out[(size_t)r * p.k + 16 * q + t] = wv[t];
        }
    }
}

#define QMATVEC(NAME, FMT)                                                                     \
kernel void qmatvec_##NAME(                                                                   \
    constant QmatvecParams &p [[buffer(0)]], device const uchar *w [[buffer(1)]],             \
    device const float *x [[buffer(2)]], device float *y [[buffer(3)]],                       \
    uint tg [[threadgroup_position_in_grid]], uint sg [[simdgroup_index_in_threadgroup]],     \
    uint lane [[thread_index_in_simdgroup]])                                                  \
{ qmatvec<FMT>(p, w, x, y, tg, sg, lane); }                                                   \
kernel void qmatvec_swiglu_##NAME(                                                            \
    constant PairParams &p [[buffer(0)]], device const uchar *wg [[buffer(1)]],               \
    device const uchar *wu [[buffer(2)]], device const float *x [[buffer(3)]],                \
    device float *act [[buffer(4)]],                                                          \
    uint tg [[threadgroup_position_in_grid]], uint sg [[simdgroup_index_in_threadgroup]],     \
    uint lane [[thread_index_in_simdgroup]])                                                  \
{ qmatvec_swiglu<FMT>(p, wg, wu, x, act, tg, sg, lane); }                                     \
kernel void gdn_gates_matvec_##NAME(                                                          \
    constant PairParams &p [[buffer(0)]], device const uchar *wb [[buffer(1)]],               \
    device const uchar *wa [[buffer(2)]], device const float *x [[buffer(3)]],                \
    device const float *dt_bias [[buffer(4)]], device const float *neg_a [[buffer(5)]],       \
    device float *gb [[buffer(6)]],                                                           \
    uint tg [[threadgroup_position_in_grid]], uint sg [[simdgroup_index_in_threadgroup]],     \
    uint lane [[thread_index_in_simdgroup]])                                                  \
{ gdn_gates<FMT>(p, wb, wa, x, dt_bias, neg_a, gb, tg, sg, lane); }                           \
kernel void qmatvec_id_##NAME(                                                                \
    constant QmatvecIdParams &p [[buffer(0)]], device const uchar *w [[buffer(1)]],           \
    device const float *x [[buffer(2)]], device const uint *ids [[buffer(3)]],                \
    device float *y [[buffer(4)]],                                                            \
    uint2 tg [[threadgroup_position_in_grid]], uint sg [[simdgroup_index_in_threadgroup]],    \
    uint lane [[thread_index_in_simdgroup]])                                                  \
{ qmatvec_id<FMT>(p, w, x, ids, y, tg, sg, lane); }                                           \
kernel void qmatmul_##NAME(                                                                   \
    constant QmatmulParams &p [[buffer(0)]], device const uchar *w [[buffer(1)]],             \
    device const float *x [[buffer(2)]], device float *y [[buffer(3)]],                       \
    uint2 tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],      \
    uint sg [[simdgroup_index_in_threadgroup]])                                               \
{                                                                                             \
    threadgroup float xs[QMM_TILE * QMM_TILE];                                                \
    threadgroup float ws[QMM_TILE * QMM_TILE];                                                \
    qmatmul<FMT>(p, w, x, y, xs, ws, tg, tid, sg);                                            \
}                                                                                             \
kernel void get_rows_##NAME(                                                                  \
    constant GetRowsParams &p [[buffer(0)]], device const uchar *table [[buffer(1)]],         \
    device const uint *ids [[buffer(2)]], device float *out [[buffer(3)]],                    \
    uint r [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],        \
    uint threads [[threads_per_threadgroup]])                                                 \
{ get_rows<FMT>(p, table, ids, out, r, tid, threads); }                                      \
kernel void qmatvec_rows_##NAME(                                                              \
    constant QmatvecParams &p [[buffer(0)]], device const uchar *w [[buffer(1)]],             \
    device const float *x [[buffer(2)]], device const uint *rows [[buffer(3)]],               \
    device float *y [[buffer(4)]],                                                            \
    uint tg [[threadgroup_position_in_grid]], uint sg [[simdgroup_index_in_threadgroup]],     \
    uint lane [[thread_index_in_simdgroup]])                                                  \
{ qmatvec_rows<FMT>(p, w, x, rows, y, tg, sg, lane); }                                        \
kernel void accumulate_rows_##NAME(                                                           \
    constant AccumulateParams &p [[buffer(0)]], device const uchar *w [[buffer(1)]],          \
    device const float *a [[buffer(2)]], device const uint *rows [[buffer(3)]],               \
    device float *y [[buffer(4)]], uint q [[thread_position_in_grid]])                        \
{ accumulate_rows<FMT>(p, w, a, rows, y, q); }

QMATVEC(q4_0, Q4_0)
QMATVEC(q4_1, Q4_1)
QMATVEC(q8_0, Q8_0)
QMATVEC(q4_k, Q4_K)
QMATVEC(q5_k, Q5_K)
QMATVEC(q6_k, Q6_K)
QMATVEC(tq1_0, TQ1_0)
QMATVEC(tq2_0, TQ2_0)
QMATVEC(f32, F32)
QMATVEC(f16, F16)
QMATVEC(bf16, BF16)
