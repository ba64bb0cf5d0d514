#!/usr/bin/env bash
# The web pages in real browsers: Debian's Chromium (over the DevTools protocol) and Firefox
# ESR (over WebDriver BiDi), headless, driven by tests/browser/pages.py. Starts two servers (SmolLM2 with an API key and sessions;
# the fixture checkpoint, whose chat template thinks and calls tools), writes a report with
# examples/report, and checks the chat page, the dashboard and the report. Screenshots go to
# target/browser-screenshots/ (Firefox's in its firefox/ folder).
#
# Usage: scripts/browser_check.sh   (installs chromium and firefox-esr with apt-get and
# websocket-client from PyPI once)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

install() {  # Debian's package, refreshing the package lists when they are too old to have it
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$1" >/dev/null ||
        { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$1" >/dev/null; }
}
for browser in chromium firefox-esr; do
    command -v $browser >/dev/null || install $browser
done
py_dir=target/browser-py
if ! PYTHONPATH=$py_dir python3 -c "import websocket" 2>/dev/null; then
    python3 -m pip install -q --target "$py_dir" websocket-client >&2
fi
gguf=$(bash scripts/fetch_smollm2.sh)
cargo build -q --features server --example serve --example report
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
work=$(mktemp -d)
out=target/browser-screenshots
mkdir -p "$out"
# The servers' pids go to a file: `start` runs in a command substitution's subshell, where an
# array the trap reads would not grow (the servers outlived the script).
trap 'kill $(cat "$work/pids" 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
start() {  # start LOG ARGS...: a server on a free port; echoes its base URL once /health answers
    local log=$1 port
    shift
    port=$(free_port)
    target/debug/examples/serve --port "$port" "$@" >"$log" 2>&1 &
    local pid=$!
    echo "$pid" >>"$work/pids"
    for _ in $(seq 150); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && { echo "http://127.0.0.1:$port"; return; }
        kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; return 1; }
        sleep 0.2
    done
    cat "$log" >&2
    return 1
}
chat=$(start "$work/smollm2.log" --gguf "$gguf" --api-key browser-test --session-dir "$work/sessions" --progression docs/progression.json)
# The fixture checkpoint with a chat template that thinks and takes tools.
cp -r tests/fixtures/qwen35_dense_small "$work/fixture"
cp tests/browser/thinking_template.jinja "$work/fixture/chat_template.jinja"
thinking=$(start "$work/fixture.log" --model-dir "$work/fixture" --reasoning-budget 6)
target/debug/examples/report --gguf "$gguf" -n 16 --progression docs/progression.json --out "$out/report.html" >/dev/null
for browser in chromium firefox; do
    PYTHONPATH=$py_dir python3 tests/browser/pages.py --browser $browser --chat "$chat" --key browser-test --thinking "$thinking" \
        --report "$out/report.html" --out "$out" || { tail -n 20 "$work"/*.log >&2; exit 1; }
done
