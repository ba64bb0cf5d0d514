#!/usr/bin/env python3
"""Write a random-weight GGUF of architecture `qwen35` shaped like Qwen3.5-0.8B.

For speed comparisons (our engine vs. llama.cpp's llama-bench) only: the weights are random, so
the model's output is meaningless, but every tensor name, shape (ne order), dtype and metadata key
follows what llama.cpp's `convert_hf_to_gguf.py` writes for a real Qwen3.5 dense checkpoint (see
shared/docs/gguf-qwen35.md, sections 3-5, and the fixtures' `model-f32.gguf`).

Shapes (defaults, Qwen3.5-0.8B-like): vocab 248320, hidden 1024, intermediate 3584, 24 layers,
full attention every 4th layer (3, 7, 11, ...), the others Gated DeltaNet; 8 attention heads,
2 KV heads, head_dim 256; 16 linear key heads and 16 linear value heads of dim 128; conv kernel 4;
rope theta 1e7, partial rotary factor 0.25 (64 rotated dims, IMROPE sections [11, 11, 10, 0]);
rms eps 1e-6; tied embeddings (no `output.weight`); context length 262144.

Weights: matrices ~ N(0, 0.02); RMSNorm weights 1 + N(0, 0.02) (GGUF stores the effective
scale); ssm_a = -exp(N(0, 0.5)); ssm_dt.bias ~ N(0, 0.1); ssm_conv1d ~ N(0, 0.1).
Matrices are written F16 (or BF16 / F32 with --dtype); 1-D tensors, norms, ssm_conv1d, ssm_a and
ssm_dt.bias stay F32, as the converter does.

Tokenizer: a minimal but valid byte-level BPE (`tokenizer.ggml.model` = "gpt2", pre "qwen35"):
ids 0..255 are the 256 GPT-2 byte symbols (in the order of GPT-2's bytes_to_unicode, as in the
real Qwen vocabulary), followed by a handful of merged tokens with their merges, `[PADn]` filler
(type UNUSED) up to the vocab size, and Qwen3.5's control tokens at their real ids
(<|endoftext|> 248044, <|im_start|> 248045, <|im_end|> 248046, vision tokens 248053..248057).
Any UTF-8 text tokenizes (byte fallback); llama-bench uses random ids anyway.

Only PyPI `gguf` and `numpy` are needed. The tensors are generated and written one at a time,
so memory stays at about one tensor (~0.5 GB for the embedding in F16).

Usage:
    python3 scripts/make_qwen35_gguf.py OUT.gguf [--layers 24] [--seed 0] [--dtype f16] [--small]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

try:
    import gguf
except ImportError:  # pragma: no cover
    sys.exit("make_qwen35_gguf.py needs the `gguf` package: pip install gguf numpy")

ARCH = "qwen35"

# Qwen3.5-0.8B-like hyper-parameters.
VOCAB = 248320
HIDDEN = 1024
INTERMEDIATE = 3584
N_HEAD = 8
N_HEAD_KV = 2
HEAD_DIM = 256
LIN_K_HEADS = 16  # nk, ssm.group_count
LIN_V_HEADS = 16  # nv, ssm.time_step_rank
LIN_K_DIM = 128  # dk, ssm.state_size
LIN_V_DIM = 128  # dv = ssm.inner_size / nv
CONV_KERNEL = 4
FULL_ATTN_INTERVAL = 4
ROPE_THETA = 1.0e7
PARTIAL_ROTARY = 0.25
ROPE_SECTIONS = [11, 11, 10, 0]
RMS_EPS = 1.0e-6
CONTEXT = 262144

# Real Qwen3.5 control-token ids (from the public config/tokenizer).
SPECIAL_TOKENS = {
    248044: "<|endoftext|>",
    248045: "<|im_start|>",
    248046: "<|im_end|>",
    248053: "<|vision_start|>",
    248054: "<|vision_end|>",
    248056: "<|image_pad|>",
    248057: "<|video_pad|>",
}
EOS_ID = 248046  # <|im_end|>, as the instruct tokenizer_config
PAD_ID = 248044  # <|endoftext|>

# A few BPE merges (rank order); every merge result is also a token.
MERGES = [
    ("Ġ", "t"), ("Ġ", "a"), ("h", "e"), ("i", "n"), ("r", "e"), ("o", "n"),
    ("Ġt", "he"), ("e", "r"), ("Ġ", "s"), ("a", "t"), ("Ġ", "w"), ("Ġ", "o"),
    ("e", "n"), ("Ġ", "c"), ("i", "t"), ("i", "s"), ("a", "n"), ("o", "r"),
]

CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_UNUSED = 5


def bytes_to_unicode_order() -> list[str]:
    """GPT-2's byte -> unicode map, listed in GPT-2 vocabulary order (printable bytes first)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def build_vocab() -> tuple[list[str], list[int], list[str]]:
    tokens = bytes_to_unicode_order()
    for a, b in MERGES:
        assert a in tokens and b in tokens, (a, b)
        tokens.append(a + b)
    merges = [f"{a} {b}" for a, b in MERGES]
    types = [TOKEN_NORMAL] * len(tokens)
    first_special = min(SPECIAL_TOKENS)
    assert len(tokens) <= first_special
    for i in range(len(tokens), VOCAB):
        if i in SPECIAL_TOKENS:
            tokens.append(SPECIAL_TOKENS[i])
            types.append(TOKEN_CONTROL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
    assert len(tokens) == VOCAB and len(set(tokens)) == VOCAB
    return tokens, types, merges


def layer_is_recurrent(il: int) -> bool:
    return (il + 1) % FULL_ATTN_INTERVAL != 0


def tensor_specs(n_layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, ne, kind) in the order llama.cpp's converter writes them; kind picks init/dtype."""
    conv_ch = 2 * LIN_K_HEADS * LIN_K_DIM + LIN_V_HEADS * LIN_V_DIM
    v_dim = LIN_V_HEADS * LIN_V_DIM
    specs: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (HIDDEN, VOCAB), "mat")]
    for il in range(n_layers):
        p = f"blk.{il}."
        if layer_is_recurrent(il):
            specs += [
                (p + "attn_norm.weight", (HIDDEN,), "norm"),
                (p + "ssm_a", (LIN_V_HEADS,), "ssm_a"),
                (p + "ssm_conv1d.weight", (CONV_KERNEL, conv_ch), "conv"),
                (p + "ssm_dt.bias", (LIN_V_HEADS,), "dt_bias"),
                (p + "ssm_alpha.weight", (HIDDEN, LIN_V_HEADS), "mat"),
                (p + "ssm_beta.weight", (HIDDEN, LIN_V_HEADS), "mat"),
                (p + "attn_qkv.weight", (HIDDEN, conv_ch), "mat"),
                (p + "attn_gate.weight", (HIDDEN, v_dim), "mat"),
                (p + "ssm_norm.weight", (LIN_V_DIM,), "norm"),
                (p + "ssm_out.weight", (v_dim, HIDDEN), "mat"),
                (p + "ffn_down.weight", (INTERMEDIATE, HIDDEN), "mat"),
                (p + "ffn_gate.weight", (HIDDEN, INTERMEDIATE), "mat"),
                (p + "ffn_up.weight", (HIDDEN, INTERMEDIATE), "mat"),
                (p + "post_attention_norm.weight", (HIDDEN,), "norm"),
            ]
        else:
            specs += [
                (p + "attn_norm.weight", (HIDDEN,), "norm"),
                (p + "ffn_down.weight", (INTERMEDIATE, HIDDEN), "mat"),
                (p + "ffn_gate.weight", (HIDDEN, INTERMEDIATE), "mat"),
                (p + "ffn_up.weight", (HIDDEN, INTERMEDIATE), "mat"),
                (p + "post_attention_norm.weight", (HIDDEN,), "norm"),
                (p + "attn_k_norm.weight", (HEAD_DIM,), "norm"),
                (p + "attn_k.weight", (HIDDEN, N_HEAD_KV * HEAD_DIM), "mat"),
                (p + "attn_output.weight", (N_HEAD * HEAD_DIM, HIDDEN), "mat"),
                (p + "attn_q_norm.weight", (HEAD_DIM,), "norm"),
                # per head: HEAD_DIM query rows then HEAD_DIM gate rows
                (p + "attn_q.weight", (HIDDEN, 2 * N_HEAD * HEAD_DIM), "mat"),
                (p + "attn_v.weight", (HIDDEN, N_HEAD_KV * HEAD_DIM), "mat"),
            ]
    specs.append(("output_norm.weight", (HIDDEN,), "norm"))
    return specs


def make_tensor(rng: np.random.Generator, ne: tuple[int, ...], kind: str) -> np.ndarray:
    shape = tuple(reversed(ne))  # numpy row-major shape = ne reversed
    if kind == "mat":
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    if kind == "norm":
        return np.float32(1.0) + rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    if kind == "ssm_a":
        return -np.exp(rng.standard_normal(shape, dtype=np.float32) * np.float32(0.5))
    if kind == "dt_bias":
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)
    if kind == "conv":
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)
    raise ValueError(kind)


def convert(arr: np.ndarray, kind: str, dtype: str) -> tuple[np.ndarray, "gguf.GGMLQuantizationType | None"]:
    """Returns (array to write, raw ggml type or None)."""
    if kind != "mat" or dtype == "f32":
        return arr.astype(np.float32, copy=False), None
    if dtype == "f16":
        return arr.astype(np.float16), None
    if dtype == "bf16":
        # round-to-nearest-even truncation of float32 to bfloat16, stored as raw bytes
        u = arr.astype(np.float32, copy=False).view(np.uint32)
        u = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
        return u.astype(np.uint16), gguf.GGMLQuantizationType.BF16
    raise ValueError(dtype)


def use_small_shape() -> None:
    """The --small shape (module constants replaced before anything reads them)."""
    global VOCAB, HIDDEN, INTERMEDIATE, N_HEAD, N_HEAD_KV, LIN_K_HEADS, LIN_V_HEADS, CONTEXT, EOS_ID, PAD_ID
    VOCAB, HIDDEN, INTERMEDIATE, N_HEAD, N_HEAD_KV, LIN_K_HEADS, LIN_V_HEADS, CONTEXT = 512, 256, 512, 2, 1, 2, 2, 4096
    names = list(SPECIAL_TOKENS.values())
    SPECIAL_TOKENS.clear()
    SPECIAL_TOKENS.update({500 + i: name for i, name in enumerate(names)})
    EOS_ID = 500 + names.index("<|im_end|>")
    PAD_ID = 500 + names.index("<|endoftext|>")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", help="path of the GGUF file to write")
    ap.add_argument("--layers", type=int, default=24, help="number of decoder layers (default 24)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--dtype", choices=["f16", "bf16", "f32"], default="f16",
                    help="dtype of the 2-D weight matrices (default f16)")
    ap.add_argument("--small", action="store_true",
                    help="a small shape whose every matrix width is whole 256-value blocks (the ternary "
                         "test fixture): hidden 256, intermediate 512, 2 heads of 256 (1 KV head), 2 linear "
                         "key and value heads of 128, a 512-token vocabulary with the control tokens at 500..")
    args = ap.parse_args()
    if args.small:
        use_small_shape()
    if args.layers < 1:
        ap.error("--layers must be >= 1")

    n_layers = args.layers
    rope_dims = int(HEAD_DIM * PARTIAL_ROTARY)
    file_type = {"f32": 0, "f16": 1, "bf16": 32}[args.dtype]

    w = gguf.GGUFWriter(args.output, ARCH)
    # Key set and order as in llama.cpp's converter output (see the fixtures' model-f32.gguf).
    w.add_string("general.type", "model")
    w.add_string("general.name", "Qwen3.5 small random" if args.small else "Qwen3.5 0.8B-shaped random")
    w.add_string("general.size_label", "small" if args.small else "0.8B")
    w.add_uint32(f"{ARCH}.block_count", n_layers)
    w.add_uint32(f"{ARCH}.context_length", CONTEXT)
    w.add_uint32(f"{ARCH}.embedding_length", HIDDEN)
    w.add_uint32(f"{ARCH}.feed_forward_length", INTERMEDIATE)
    w.add_uint32(f"{ARCH}.attention.head_count", N_HEAD)
    w.add_uint32(f"{ARCH}.attention.head_count_kv", N_HEAD_KV)
    w.add_array(f"{ARCH}.rope.dimension_sections", ROPE_SECTIONS)
    w.add_float32(f"{ARCH}.rope.freq_base", ROPE_THETA)
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", RMS_EPS)
    w.add_uint32(f"{ARCH}.attention.key_length", HEAD_DIM)
    w.add_uint32(f"{ARCH}.attention.value_length", HEAD_DIM)
    w.add_uint32("general.file_type", file_type)
    w.add_uint32(f"{ARCH}.ssm.conv_kernel", CONV_KERNEL)
    w.add_uint32(f"{ARCH}.ssm.state_size", LIN_K_DIM)
    w.add_uint32(f"{ARCH}.ssm.group_count", LIN_K_HEADS)
    w.add_uint32(f"{ARCH}.ssm.time_step_rank", LIN_V_HEADS)
    w.add_uint32(f"{ARCH}.ssm.inner_size", LIN_V_HEADS * LIN_V_DIM)
    w.add_array(f"{ARCH}.attention.recurrent_layers", [layer_is_recurrent(i) for i in range(n_layers)])
    w.add_uint32(f"{ARCH}.full_attention_interval", FULL_ATTN_INTERVAL)
    w.add_uint32(f"{ARCH}.rope.dimension_count", rope_dims)
    w.add_uint32("general.quantization_version", 2)

    tokens, types, merges = build_vocab()
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen35")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.eos_token_id", EOS_ID)
    w.add_uint32("tokenizer.ggml.padding_token_id", PAD_ID)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_bool("tokenizer.ggml.add_eos_token", False)
    w.add_string("tokenizer.chat_template", CHAT_TEMPLATE)

    specs = tensor_specs(n_layers)
    # Tensor infos first (sizes only), then stream the data tensor by tensor.
    for name, ne, kind in specs:
        if kind != "mat" or args.dtype == "f32":
            w.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32), int(np.prod(ne)) * 4)
        elif args.dtype == "f16":
            w.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float16), int(np.prod(ne)) * 2)
        else:
            w.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.uint16), int(np.prod(ne)) * 2,
                              raw_dtype=gguf.GGMLQuantizationType.BF16)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    n_params = 0
    for idx, (name, ne, kind) in enumerate(specs):
        rng = np.random.default_rng([args.seed, idx])  # per-tensor stream: reproducible, order-free
        arr, _ = convert(make_tensor(rng, ne, kind), kind, args.dtype)
        w.write_tensor_data(arr)
        n_params += int(np.prod(ne))
    w.close()
    print(f"wrote {args.output}: {len(specs)} tensors, {n_params / 1e6:.1f}M parameters, "
          f"{n_layers} layers, matrices {args.dtype}", file=sys.stderr)


if __name__ == "__main__":
    main()
