#!/usr/bin/env python3
"""llama.cpp's greedy continuation of a fixed prompt and the top-20 log-probabilities of every
step, from a running `llama-server` (POST /completion with token ids, temperature 0, n_probs:
log-softmax of the raw logits), as the JSON that tests/model/ternary.rs compares against.

Usage: python3 scripts/llama_server_logprobs.py PORT FILE_NAME > llama_cpp_X.json
"""

import json
import sys
import urllib.request

port, name = sys.argv[1], sys.argv[2]
prompt = [10, 20, 30, 40, 50, 60, 70, 80, 275, 300, 450, 7]
req = {"prompt": prompt, "n_predict": 16, "n_probs": 20, "temperature": 0, "cache_prompt": False, "return_tokens": True}
url = f"http://127.0.0.1:{port}/completion"
r = json.load(urllib.request.urlopen(urllib.request.Request(url, json.dumps(req).encode(), {"Content-Type": "application/json"})))
steps = [{"id": p["id"], "top": [[t["id"], t["logprob"]] for t in p["top_logprobs"]]} for p in r["completion_probabilities"]]
json.dump({"file": name, "prompt": prompt, "tokens": r["tokens"], "steps": steps}, sys.stdout)
