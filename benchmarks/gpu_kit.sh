#!/usr/bin/env bash
# The GPU kit: download into DIR (default .whl/, git-ignored) the wheels that benchmarks/gpu_kit.lock pins: what
# runner needs and benchmarks/gpu_image_packages.txt's image lacks, for CPython 3.12 on manylinux x86_64, each
# with --no-deps (the lock already holds their dependencies); its fallback wheels go to DIR/fallback/.
# benchmarks/gpu_check.sh installs them on a GPU machine without network.
#   benchmarks/gpu_kit.sh [--lock] [DIR]
#   --lock  first resolve runner's dependencies again on the package index and rewrite gpu_kit.lock
# Environment: PYTHON (runs pip; default .venv/bin/python, else python3), PYVER (the target's Python, default 3.12),
# LIMIT_MIB (default 40). Exit status: 0 when every pinned wheel came and the kit fits under LIMIT_MIB, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
PYVER=${PYVER:-3.12}
LIMIT_MIB=${LIMIT_MIB:-40}
if [ "${1:-}" = "--lock" ]; then
    "$PY" benchmarks/gpu_kit.py lock
    shift
fi
DIR=${1:-.whl}

platforms=()
for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" benchmarks/gpu_kit.py requirements >"$tmp/all.txt"
sed '/^--fallback$/,$d' "$tmp/all.txt" >"$tmp/kit.txt"
sed '1,/^--fallback$/d' "$tmp/all.txt" >"$tmp/fallback.txt"
download() {  # download DEST REQUIREMENTS
    PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip download -q --no-deps --only-binary=:all: \
        --python-version "$PYVER" --implementation cp "${platforms[@]}" -d "$1" -r "$2"
}
download "$tmp/kit" "$tmp/kit.txt"
download "$tmp/kit/fallback" "$tmp/fallback.txt"
want=$(grep -c . "$tmp/kit.txt")
got=$(find "$tmp/kit" -maxdepth 1 -name '*.whl' | wc -l)
if [ "$got" -ne "$want" ]; then
    echo "gpu_kit: $got wheels for $want pins in benchmarks/gpu_kit.lock" >&2
    exit 1
fi
rm -rf "$DIR"
mv "$tmp/kit" "$DIR"
bytes=$(du -sb "$DIR" | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "gpu_kit: $DIR: $got wheels + $(grep -c . "$tmp/fallback.txt") fallbacks for Python $PYVER, $mib MiB (limit $LIMIT_MIB MiB)"
[ "$bytes" -le $((LIMIT_MIB * 1048576)) ]
