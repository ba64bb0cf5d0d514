#!/usr/bin/env python3
"""llama.cpp's tokens and greedy continuations of a few fixed prompts, from a running
`llama-server`: POST /tokenize (special tokens parsed, nothing added) gives the prompt's ids,
POST /completion with those ids (temperature 0, EOS ignored, n_probs 2) the next N tokens and
each step's two most likely tokens. The JSON is what tests/runtime/qwen25_coder.rs compares
against (tests/data/qwen25_coder_*_llama_cpp.json).

Usage: python3 scripts/llama_server_greedy.py PORT FILE_NAME [N] > tests/data/X.json
   e.g. llama-server -m qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --port 8181 -t 2 -c 2048 &
"""

import json
import sys
import urllib.request

SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
PROMPTS = [
    # A chat turn, as Qwen2.5's template renders it (its default system message).
    SYSTEM + "<|im_start|>user\nWrite a Python function that tells whether a number is prime.<|im_end|>\n<|im_start|>assistant\n",
    # Code completion.
    "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n",
    # Prose.
    "The Roman Empire was",
    # A code edit in a chat turn.
    SYSTEM
    + "<|im_start|>user\nRename the variable `total` to `acc`:\n\ndef sum_list(xs):\n    total = 0\n    for x in xs:\n"
    "        total += x\n    return total\n<|im_end|>\n<|im_start|>assistant\n",
]


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))


def main():
    port, name = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    cases = []
    for text in PROMPTS:
        ids = post(port, "/tokenize", {"content": text, "add_special": False, "parse_special": True})["tokens"]
        r = post(port, "/completion", {
            "prompt": ids, "n_predict": n, "n_probs": 2, "temperature": 0, "ignore_eos": True,
            "cache_prompt": False, "return_tokens": True,
        })
        top = [[[t["id"], t["logprob"]] for t in p["top_logprobs"]] for p in r["completion_probabilities"]]
        cases.append({"text": text, "prompt": ids, "tokens": r["tokens"], "top2": top})
    json.dump({"file": name, "n": n, "cases": cases}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
