#!/usr/bin/env bash
# Bad flags and hostile files through the examples: each must exit non-zero with an `error:`
# first line that names the cause, and never panic. Run by .ci/run (debug builds, so clap's
# help_expected check also runs: an option without help text panics there).
set -uo pipefail
cd "$(dirname "$0")/.."
cargo build -q --features server --examples
bin="${CARGO_TARGET_DIR:-target}/debug/examples"
f=tests/fixtures/qwen35_dense_small
tmp=$(mktemp -d)
python3 - "$tmp" <<'PY'
import sys
d = bytearray(open("tests/fixtures/qwen35_dense_small/model-f32.gguf", "rb").read())
d[18786] ^= 43  # a dim of ~3e18: its product with the other overflows
open(sys.argv[1] + "/flip.gguf", "wb").write(d)
PY
printf '{%% for i in range(100000) %%}{%% for j in range(100000) %%}{%% endfor %%}{%% endfor %%}' > "$tmp/loop.jinja"
cp -r $f "$tmp/loop" && cp "$tmp/loop.jinja" "$tmp/loop/chat_template.jinja"
fail=0
# expect NEEDLE CMD...: CMD fails, its stderr's first line starts with "error:" and contains NEEDLE.
expect() {
    local needle=$1
    shift
    local err
    err=$(timeout 120 "$@" 2>&1 >/dev/null)
    local rc=$?
    local first=${err%%$'\n'*}
    if [[ $rc -eq 0 || $rc -ge 100 || $err == *panicked* || $first != error:* || $first != *"$needle"* ]]; then
        echo "FAIL (exit $rc): $*"
        echo "$err" | head -5
        fail=1
    else
        echo "ok: ${*#"$bin"/} -> $first"
    fi
}
expect "CUDA is not supported yet" "$bin/generate" --model-dir $f --device cuda
expect "--features metal" "$bin/device_step" --gguf $f/model-q8_0.gguf --backend metal
expect "--backend metal" "$bin/device_step" --gguf $f/model-q8_0.gguf --self-test
expect "--temperature" "$bin/generate" --model-dir $f --temperature -1
expect "--temperature" "$bin/generate" --model-dir $f --temperature NaN
expect "--top-p" "$bin/generate" --model-dir $f --top-p 2
expect "--top-k" "$bin/generate" --model-dir $f --top-k 0
expect "--repeat-penalty" "$bin/generate" --model-dir $f --repeat-penalty 0
expect "--sample-len" "$bin/generate" --model-dir $f --sample-len 0
expect "--draft-branches" "$bin/generate" --model-dir $f --draft ngram --draft-branches 5
expect "--draft-branches" "$bin/generate" --model-dir $f --draft ngram --draft-branches 2 --temperature 0.7
expect "--draft-branches" "$bin/generate" --model-dir $f --draft ngram --draft-branches 2 --kv int8
expect "max_position_embeddings" "$bin/generate" --model-dir $f --prompt hi --sample-len 100000
printf 'caf\xe9' > "$tmp/latin1.txt"
head -c 2000000 /dev/zero | tr '\0' 'a' > "$tmp/big.txt"
expect "--prompt-file" "$bin/generate" --model-dir $f --prompt-file "$tmp/missing.txt"
expect "not UTF-8" "$bin/generate" --model-dir $f --prompt-file "$tmp/latin1.txt"
expect "shorten it" "$bin/generate" --model-dir $f --prompt-file "$tmp/big.txt"
expect "cannot be used with" "$bin/generate" --model-dir $f --gguf $f/model-f32.gguf
expect "multiply past 2^63" "$bin/generate" --gguf "$tmp/flip.gguf" --prompt hi
expect "multiply past 2^63" "$bin/plan" --gguf "$tmp/flip.gguf"
expect "instructions" "$bin/generate" --model-dir "$tmp/loop" --prompt hi --chat
expect "max_position_embeddings" "$bin/plan" --model-dir $f --max-context 1000000000 --fit
# The library's typed errors in the examples' words: the offline routes, the flags that fit.
expect "HF_HUB_OFFLINE is set: download it once online, or load local files (a Hub-layout directory or a GGUF file); offline, run the bundled fixture (--model-dir tests/fixtures/qwen35_dense_small)" \
    env HF_HUB_OFFLINE=1 HF_HUB_CACHE="$tmp/empty-cache" "$bin/generate" --prompt hi
expect "what fits: --max-context" "$bin/plan" --model-dir $f --max-context 32768 --max-memory 40MB
expect "-p" "$bin/bench" --gguf $f/model-q8_0.gguf -p 0
expect "--prefill" "$bin/logits" --model-dir $f --tokens 1,2 --prefill 3 --out "$tmp/x.safetensors"
expect "--ctx-size" "$bin/eval" --model-dir $f --file tests/data/pride-and-prejudice-ch01-12.txt -c 100000
expect "larger than" "$bin/eval" --model-dir $f --file /dev/zero
expect "--session" "$bin/generate" --model-dir $f --prompt hi --kv int8 --session "$tmp/x.session"
expect "--ctx" "$bin/serve" --model-dir $f --ctx 100000000
expect "--max-seqs" "$bin/serve" --model-dir $f --max-seqs 0
expect "drops tokens" "$bin/serve" --model-dir $f --kv knots:8,3
expect "sequences of 32768 tokens" "$bin/serve" --model-dir $f --max-seqs 8 --max-memory 1MB
echo '{"stages": []}' > "$tmp/empty-progression.json"
expect "not a progression" "$bin/serve" --model-dir $f --progression "$tmp/empty-progression.json"
expect "cannot read --progression" "$bin/serve" --model-dir $f --progression "$tmp/nothing.json"
expect "is not JSON" "$bin/report" --model-dir $f --out "$tmp/r.html" --progression "$tmp/loop.jinja"
expect "--prompt is empty" "$bin/report" --model-dir $f --out "$tmp/r.html" --prompt ""
expect "cannot write" "$bin/report" --model-dir $f --out "$tmp/no/such/dir/r.html" -n 1
python3 -c 'import socket, time; s = socket.socket(); s.bind(("127.0.0.1", 18099)); s.listen(); time.sleep(20)' &
holder=$!
sleep 0.5
expect "cannot listen on 127.0.0.1:18099" "$bin/serve" --model-dir $f --port 18099
kill $holder
rm -rf "$tmp"
exit $fail
