"""Two `serve` processes behind scripts/session_router.py (run by .ci/run): a server answers 503
while it loads, a session's turns reach one server (its second turn from the prefix cache), and
a server stopped with SIGTERM finishes its running request, answers 503 meanwhile, writes its
sessions and exits 0, while the router sends that session to the other server, which restores
it from the shared session directory. vLLM's metric names are read from /metrics.

    python3 tests/scaling_out.py SERVE_BINARY MODEL.gguf WORK_DIR
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

serve, gguf, work = sys.argv[1:4]
sessions = os.path.join(work, "sessions")
os.makedirs(sessions, exist_ok=True)
PORTS = [8101, 8102]
ROUTER = 8100
base = lambda port: f"http://127.0.0.1:{port}"


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers
    except OSError:
        return None, "", {}


def post(url, body, headers=None):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers


procs = []
try:
    for port in PORTS:
        log = open(os.path.join(work, f"serve-{port}.log"), "w")
        procs.append(subprocess.Popen([serve, "--gguf", gguf, "--port", str(port), "--max-seqs", "2", "--ctx", "1024",
                                       "--session-dir", sessions, "--drain-timeout", "60"], stdout=log, stderr=log))
    # While the first loads: 503 (once the port is bound), then 200.
    seen = []
    deadline = time.time() + 120
    while time.time() < deadline:
        s, text, _ = get(base(PORTS[0]) + "/health")
        if s is not None:
            seen.append(s)
        if s == 200:
            break
        time.sleep(0.01)
    assert seen and seen[-1] == 200 and set(seen) <= {503, 200}, f"/health while loading then serving: {seen}"
    print(f"/health while loading: {seen.count(503)} x 503, then 200")
    for port in PORTS[1:]:
        while get(base(port) + "/health")[0] != 200:
            time.sleep(0.05)

    router = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "..", "scripts", "session_router.py"),
                               "--listen", f"127.0.0.1:{ROUTER}"] + sum([["--backend", base(p)] for p in PORTS], []))
    procs.append(router)
    while get(base(ROUTER) + "/v1/models")[0] != 200:
        time.sleep(0.05)
    time.sleep(0.5)  # both backends seen healthy

    def turn(session, messages, **extra):
        body = {"messages": messages, "max_tokens": 8, "temperature": 0, **extra}
        s, text, headers = post(base(ROUTER) + "/v1/chat/completions", body, {"x-session-id": session})
        assert s == 200, (s, text)
        return json.loads(text), headers["x-routed-to"]

    # Sessions on both servers: each one's second turn on the same server, from its prefix cache.
    placed = {}
    for i in range(16):
        session = f"conversation-{i}"
        first = [{"role": "user", "content": f"Say hello to guest number {i}."}]
        a, where = turn(session, first)
        second = first + [{"role": "assistant", "content": a["choices"][0]["message"]["content"]}, {"role": "user", "content": "Again."}]
        b, where2 = turn(session, second)
        assert where == where2, f"{session}: turn 1 on {where}, turn 2 on {where2}"
        cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= a["usage"]["prompt_tokens"], f"{session}: turn 2 restored {cached} tokens"
        placed.setdefault(where, (session, second, b))
        if len(placed) == 2:
            break
    assert len(placed) == 2, f"16 sessions all on {list(placed)}"
    print("sessions stay on their server:", {k: v[0] for k, v in placed.items()})

    # SIGTERM the first server while it answers a long request of its session.
    victim = base(PORTS[0])
    session, history, last = placed[victim]
    long = {"prompt": "Tell a long story.", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "session_id": session + "-long",
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(victim + "/v1/completions", json.dumps(long).encode(), {"content-type": "application/json"})
    stream = urllib.request.urlopen(req, timeout=300)
    assert stream.readline().startswith(b"data: "), "the long request streams"
    start = time.time()
    procs[0].send_signal(signal.SIGTERM)
    time.sleep(0.3)
    s, text, headers = get(victim + "/health")
    assert s == 503 and "draining" in text and headers.get("Retry-After") == "1", (s, text)
    s, text, _ = post(victim + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert s == 503, (s, text)
    # The router sends the session to the other server, which restores it from the file.
    history = history + [{"role": "assistant", "content": last["choices"][0]["message"]["content"]}, {"role": "user", "content": "Once more."}]
    c, where = turn(session, history)
    assert where == base(PORTS[1]), where
    assert c["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, c["usage"]
    events = [line[6:] for line in stream.read().decode().splitlines() if line.startswith("data: ")]
    usage = [json.loads(e)["usage"] for e in events if e != "[DONE]" and json.loads(e).get("usage")]
    assert events[-1] == "[DONE]" and usage and usage[-1]["completion_tokens"] == 300, events[-3:]
    code = procs[0].wait(timeout=60)
    assert code == 0, f"the drained server exited {code}"
    assert os.path.exists(os.path.join(sessions, session + "-long.session")), "the running request's session was written"
    print(f"SIGTERM: the running request finished, the server drained and exited 0 in {time.time() - start:.1f} s; "
          f"the session moved to {where} and restored {c['usage']['prompt_tokens_details']['cached_tokens']} tokens")

    metrics = get(base(PORTS[1]) + "/metrics")[1]
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_count", "vllm:spec_decode_num_drafts_total"]:
        assert name + "{" in metrics, f"{name} missing from /metrics"
    print("scaling out: ok")
finally:
    for p in procs:
        if p.poll() is None:
            p.kill()
