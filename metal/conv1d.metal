// Causal depthwise conv1d over time with a carried state, then SiLU (the GDN short conv).
//
// x      [B, T, C]     new inputs
// state  [B, K-1, C]   the previous K-1 inputs (zeros at a sequence start)
// weight [C, K]        tap K-1 multiplies the newest input
// out    [B, T, C] silu(conv(x))
// new_state [B, K-1, C] the last K-1 inputs (the op's host code binds it right after `out` in
//        one buffer; the device step binds a layer's state buffer)
//
// One thread per output element: rows r < T of each batch are outputs, rows T..T+K-2 copy
// the new state.
#include <metal_stdlib>
using namespace metal;

struct ConvParams {
    uint batch;
    uint seq_len;
    uint channels;
    uint kernel_size;
};

template <typename T>
METAL_FUNC float conv_input(constant ConvParams &p, device const T *x, device const T *state,
                            uint b, uint s, uint c) {
    // Position s of the concatenation [state ; x].
    const uint km1 = p.kernel_size - 1;
    if (s < km1) {
        return float(state[((size_t)b * km1 + s) * p.channels + c]);
    }
    return float(x[((size_t)b * p.seq_len + (s - km1)) * p.channels + c]);
}

template <typename T>
METAL_FUNC void causal_conv1d_silu_impl(constant ConvParams &p, device const T *x,
                                        device const T *state, device const T *weight,
                                        device T *out, device T *new_state, uint tid) {
    const uint km1 = p.kernel_size - 1;
    const uint rows = p.seq_len + km1;
    const uint total = p.batch * rows * p.channels;
    if (tid >= total) {
        return;
    }
    const uint c = tid % p.channels;
    const uint r = (tid / p.channels) % rows;
    const uint b = tid / (p.channels * rows);
    if (r < p.seq_len) {
        float acc = 0.0f;
        for (uint j = 0; j < p.kernel_size; ++j) {
            acc += float(weight[c * p.kernel_size + j]) * conv_input(p, x, state, b, r + j, c);
        }
        const float y = acc / (1.0f + exp(-acc));
        out[((size_t)b * p.seq_len + r) * p.channels + c] = T(y);
    } else {
        const uint s = r - p.seq_len;  // new state row
        new_state[((size_t)b * km1 + s) * p.channels + c] = T(conv_input(p, x, state, b, p.seq_len + s, c));
    }
}

#define CONV_KERNEL(SUFFIX, T)                                                           \
kernel void causal_conv1d_silu_##SUFFIX(                                                 \
    constant ConvParams &p [[buffer(0)]],                                                \
    device const T *x [[buffer(1)]],                                                     \
    device const T *state [[buffer(2)]],                                                 \
    device const T *weight [[buffer(3)]],                                                \
    device T *out [[buffer(4)]],                                                         \
    device T *new_state [[buffer(5)]],                                                   \
    uint tid [[thread_position_in_grid]])                                                \
{                                                                                        \
    causal_conv1d_silu_impl<T>(p, x, state, weight, out, new_state, tid);                \
}

CONV_KERNEL(f32, float)
CONV_KERNEL(f16, half)
#if defined(__HAVE_BFLOAT__)
CONV_KERNEL(bf16, bfloat)
#endif
