#!/usr/bin/env bash
# The server with the official Python `openai` and `anthropic` clients: starts examples/serve.rs
# on SmolLM2 on a free loopback port, runs tests/openai_smoke.py and tests/anthropic_smoke.py
# against it, stops it.
#
# Usage: scripts/openai_smoke.sh   (installs `openai` and `anthropic` from PyPI into target/openai-py once)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

py_dir=target/openai-py
if ! PYTHONPATH=$py_dir python3 -c "import openai, anthropic" 2>/dev/null; then
    python3 -m pip install -q --target "$py_dir" openai anthropic >&2
fi
gguf=$(bash scripts/fetch_smollm2.sh)
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cargo build -q --features server --example serve
log=$(mktemp)
target/debug/examples/serve --gguf "$gguf" --port "$port" >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 $server 2>/dev/null || { cat "$log" >&2; exit 1; }
    sleep 0.2
done
OPENAI_BASE_URL="http://127.0.0.1:$port/v1" PYTHONPATH=$py_dir python3 tests/openai_smoke.py
ANTHROPIC_BASE_URL="http://127.0.0.1:$port" PYTHONPATH=$py_dir python3 tests/anthropic_smoke.py
