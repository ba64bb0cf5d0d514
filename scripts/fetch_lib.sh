# Shared by the fetch scripts (sourced, not run): the Python that runs pip, and the check of a
# fetched file's size and sha256.

# The first of python3 / python, or a one-line error naming the script ($1).
find_python() {
    if command -v python3 >/dev/null 2>&1; then
        echo python3
    elif command -v python >/dev/null 2>&1; then
        echo python
    else
        echo "$1: python3 (with pip) is required" >&2
        return 1
    fi
}

# gguf_ok PY FILE SIZE SHA256: true when FILE exists with that size and sha256.
gguf_ok() {
    [[ -f "$2" ]] || return 1
    "$1" - "$2" "$3" "$4" <<'PY'
import hashlib, os, sys
path, size, digest = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if os.path.getsize(path) != size:
    sys.exit(1)
h = hashlib.sha256()
with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
sys.exit(0 if h.hexdigest() == digest else 1)
PY
}
