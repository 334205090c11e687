#!/usr/bin/env bash
# GPU check: every CUDA path of runner in one run of a few minutes, on a machine with NVIDIA GPUs, no network needed.
#   benchmarks/gpu_check.sh              on the GPU machine, from the repository root
#   benchmarks/gpu_check.sh --dry-run    rehearsal on CPU: builds the kit, runs the parts that need no GPU
#   benchmarks/gpu_check.sh --bundle     at the end, pack everything but the summary and the log into one file
# Runner's dependencies come from the interpreter if it holds them (a plain `pip install .`), else from the kit
# (.whl/, written by benchmarks/gpu_kit.sh): installed with --no-index --no-deps into a scratch folder on PYTHONPATH,
# with runner itself taken from this working tree. Each part is a function part_NAME below, run with a time limit;
# parts that need two GPUs or a feature this version lacks are listed as not run, with the reason.
# Results go to $OUT (default: a new temporary folder): summary.txt (the table printed last), gpu_check.log (all
# output), detail/ (one log per part, the cuda tests' junit XML, the MLflow store mlflow.db with its artifacts,
# bench.json); with --bundle detail/ becomes gpu_check_detail.tar.gz.
# Environment: PYTHON (default python3; dry run: .venv/bin/python, else python3), KIT (default .whl),
# BUDGET_S (default 480: parts that would start later are not run), SPEC (default experiments/digits_mlp.toml).
# Exit status: 0 when every part that ran passed, 1 otherwise, 2 for bad usage.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DRY=0
BUNDLE=0
for arg in "$@"; do
    case $arg in
        --dry-run) DRY=1 ;;
        --bundle) BUNDLE=1 ;;
        -h | --help) sed -n '2,/^set -uo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check: unknown argument $arg (see --help)" >&2; exit 2 ;;
    esac
done
OUT=${OUT:-$(mktemp -d -t gpu-check.XXXXXX)}
DETAIL=$OUT/detail
KIT=${KIT:-.whl}
BUDGET_S=${BUDGET_S:-$([ "$DRY" = 1 ] && echo 900 || echo 480)}
SCALE=$([ "$DRY" = 1 ] && echo 3 || echo 1)  # a CPU takes longer: the parts' own limits are multiplied
SPEC=$REPO/${SPEC:-experiments/digits_mlp.toml}
SCRATCH=$(mktemp -d -t gpu-check-scratch.XXXXXX)
trap 'rm -rf "$SCRATCH"' EXIT
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ "$DRY" = 1 ] && [ -x .venv/bin/python ]; then PY=$REPO/.venv/bin/python; else PY=python3; fi
fi
mkdir -p "$DETAIL/runs"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
TEE=$!
export PYTHONPATH=$REPO PYTHONUNBUFFERED=1 MLFLOW_TRACKING_URI=sqlite:///$DETAIL/mlflow.db
ACCEL=cuda
[ "$DRY" = 1 ] && ACCEL=cpu
NGPU=0
command -v nvidia-smi >/dev/null && NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
START=$SECONDS
ROWS=()
FAILED=0

# ---- helpers ----------------------------------------------------------------------------------------------------
row() { ROWS+=("$(printf '%-16s %-34s %7s  %s' "$1" "$2" "$3" "$4")"); }
not_run() { row "$1" "not run" "-" "$2"; echo "== $1: not run: $2"; }
runner() { "$PY" -m runner "$@"; }
exec_run() { (cd "$DETAIL/runs" && runner exec "$CHECK_SPEC" --set train.epochs=1 "$@"); }
schema_has() {  # schema_has fsdp | schema_has key:compile: the spec schema names the value or the key
    runner schema | "$PY" -c '
import json, sys
want, found = sys.argv[1], False
def walk(x):
    global found
    if isinstance(x, dict):
        found |= want.startswith("key:") and want[4:] in x.get("properties", {})
        found |= want in x.get("enum", ()) or x.get("const") == want
        [walk(v) for v in x.values()]
    elif isinstance(x, list):
        [walk(v) for v in x]
walk(json.load(sys.stdin))
sys.exit(0 if found else 1)' "$1"
}
part() {  # part NAME LIMIT_S [show]: run part_NAME in a process group killed after LIMIT_S (or the budget left)
    local name=$1 limit=$2 show=${3:-} t0=$SECONDS rc left=$((BUDGET_S - SECONDS + START))
    if [ "$left" -le 0 ]; then
        not_run "$name" "time budget ($BUDGET_S s) spent"
        return
    fi
    limit=$((limit * SCALE))
    [ "$left" -lt "$limit" ] && limit=$left
    echo "== $name"
    if [ -n "$show" ]; then
        timeout -k 10 "$limit" bash -c "part_${name//-/_}" 2>&1 | tee "$DETAIL/$name.log"
        rc=${PIPESTATUS[0]}
    else
        timeout -k 10 "$limit" bash -c "part_${name//-/_}" >"$DETAIL/$name.log" 2>&1
        rc=$?
    fi
    local secs=$((SECONDS - t0)) last
    last=$(tail -n 1 "$DETAIL/$name.log")
    if grep -q '^status: ' "$DETAIL/$name.log"; then  # a run: its status and speed
        last="$(grep -m1 '^status: ' "$DETAIL/$name.log" | cut -c9-), $(grep -m1 'samples_per_s' "$DETAIL/$name.log" | xargs)"
    fi
    last=$(echo "$last" | cut -c1-100)
    if [ "$rc" = 0 ]; then
        row "$name" "passed" "$secs" "$last"
    elif [ "$rc" = 99 ]; then
        row "$name" "not run" "$secs" "$last"
    else
        FAILED=1
        [ -z "$show" ] && tail -n 25 "$DETAIL/$name.log"
        [ "$rc" = 124 ] && last="stopped after $limit s"
        row "$name" "FAILED (exit $rc)" "$secs" "$last"
    fi
    echo "   $name: exit $rc, $secs s"
}
skip() { echo "$1"; exit 99; }  # inside a part: report it as not run, with the reason

# ---- the kit ----------------------------------------------------------------------------------------------------
install_kit() {  # install_kit PYTHON WHEELS TARGET: the kit with --no-index --no-deps, then the fallbacks needed
    "$1" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$3" "$2"/*.whl || return 1
    local extra
    extra=$(PYTHONPATH=$3:$PYTHONPATH "$1" benchmarks/gpu_kit.py fallbacks "$2/fallback") || return 1
    if [ -n "$extra" ]; then
        echo "fallbacks for too-old image packages: $extra"
        # shellcheck disable=SC2086
        "$1" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$3" $extra
    fi
}
part_kit() {
    [ "$DRY" = 1 ] && { kit_dry; return; }
    if "$PY" -c "import mlflow, pydantic, optuna, tomli_w" 2>/dev/null; then
        skip "not needed: $PY holds runner's dependencies"
    fi
    if ! ls "$KIT"/*.whl >/dev/null 2>&1; then
        echo "$PY lacks runner's dependencies and $KIT/ holds no wheels: run benchmarks/gpu_kit.sh where there is network"
        return 1
    fi
    install_kit "$PY" "$KIT" "$SCRATCH/site" && echo "$(ls "$KIT"/*.whl | wc -l) wheels from $KIT/ in $SCRATCH/site"
}
kit_dry() {  # the real kit (Python 3.12) built and installed for its target; one for this Python if it differs
    local ver platforms=()
    benchmarks/gpu_kit.sh "$KIT" || return 1
    for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SCRATCH/site312" --python-version 3.12 \
        --implementation cp --only-binary=:all: "${platforms[@]}" "$KIT"/*.whl || return 1
    echo "installed $(ls "$KIT"/*.whl | wc -l) wheels for Python 3.12 into a fresh target"
    ver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    local wheels=$KIT
    if [ "$ver" != 3.12 ]; then
        wheels=$SCRATCH/whl-$ver
        PYVER=$ver LIMIT_MIB=100 benchmarks/gpu_kit.sh "$wheels" || return 1
    fi
    # this interpreter's packages that the GPU image holds (torch stands for the image's), and nothing else
    "$PY" benchmarks/gpu_kit.py view "$SCRATCH/image" || return 1
    "$PY" -m venv --without-pip "$SCRATCH/env" || return 1
    local sitedir
    sitedir=$("$SCRATCH/env/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    echo "$SCRATCH/image" >"$sitedir/gpu_check_image.pth"
    install_kit "$SCRATCH/env/bin/python" "$wheels" "$SCRATCH/site" || return 1
    echo "the image stand-in $SCRATCH/env holds the image's packages of $PY and the kit for Python $ver"
}
part_import() {
    "$PY" - "$SCRATCH/site" <<'EOF' || return 1
import sys, importlib.metadata as md
import mlflow, optuna, pydantic, tomli_w, torch, runner
site = sys.argv[1]
assert not torch.__file__.startswith(site), f"torch came from the kit: {torch.__file__}"
for m in (mlflow, optuna, pydantic, runner, torch):
    print(f"{m.__name__:9} {getattr(m, '__version__', '?'):14} {m.__file__}")
print("torch cuda", torch.version.cuda, "built", torch.backends.cuda.is_built())
EOF
    if [ -d "$SCRATCH/site" ]; then  # the kit was installed: do the image's packages meet its requirements?
        "$PY" benchmarks/gpu_kit.py conflicts || echo "(the image's versions above differ from the kit's; imports decide)"
    fi
    runner --version && runner validate "$REPO"/experiments/*.toml
}

# ---- the parts --------------------------------------------------------------------------------------------------
part_inventory() {
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version,pci.bus_id --format=csv
        nvidia-smi -q >"$DETAIL/nvidia-smi-q.txt"
    fi
    "$PY" -c '
import sys, torch
from runner.devices.inventory import probe_inventory
inv = probe_inventory()
print("runner inventory (NVML):", inv)
print("torch", torch.__version__, "cuda", torch.version.cuda, "visible GPUs", torch.cuda.device_count())
if sys.argv[1] == "cuda" and not torch.cuda.device_count():
    sys.exit("torch sees no GPU: every CUDA part would fail or skip")' "$ACCEL"
}
part_cuda_tests() {  # every test file with a cuda mark but the sync-debug one (its own part)
    local files
    files=$(grep -l "mark.cuda" tests/*.py tests/*/*.py | grep -v test_cuda_sync.py)
    [ "$DRY" = 1 ] && files="$files tests/test_cuda_sync.py"
    # shellcheck disable=SC2086
    "$PY" -m pytest -n 0 -m cuda -p no:cacheprovider -q -rs --junitxml="$DETAIL/cuda-tests.xml" $files
}
part_sync_debug() {
    [ "$DRY" = 1 ] && skip "dry run: cuda-tests collected it"
    "$PY" -m pytest -n 0 -p no:cacheprovider -q -rs --junitxml="$DETAIL/sync-debug.xml" tests/test_cuda_sync.py
}
part_none() { exec_run --set parallel.mode=none; }
part_dp_1() {
    [ "$DRY" = 1 ] && skip "dry run: dp needs CUDA"
    local plan
    plan=$(cd "$DETAIL/runs" && runner plan "$CHECK_SPEC" --set parallel.mode=dp --set 'devices.ids=[0]' 2>&1)
    echo "$plan"
    if grep -q '^  cannot run' <<<"$plan"; then
        skip "runner plan refuses dp with ids = [0]: $(grep -m1 '^  cannot run' <<<"$plan" | sed 's/^  cannot run *//')"
    fi
    exec_run --set parallel.mode=dp --set 'devices.ids=[0]'
}
part_ddp_1() {
    local backend=nccl
    [ "$DRY" = 1 ] && backend=gloo
    exec_run --set parallel.mode=ddp --set parallel.backend=$backend --set 'devices.ids=[0]'
}
part_amp_bf16() { [ "$DRY" = 1 ] && skip "dry run: CUDA part"; exec_run --set train.amp=bf16; }
part_amp_fp16() { [ "$DRY" = 1 ] && skip "dry run: CUDA part"; exec_run --set train.amp=fp16; }
part_dp_2() { exec_run --set parallel.mode=dp --set 'devices.ids=[0,1]'; }
part_ddp_2() { exec_run --set parallel.mode=ddp --set parallel.backend=nccl --set 'devices.ids=[0,1]'; }
part_fsdp() {
    schema_has fsdp || skip "not available in this version (parallel.mode has no fsdp)"
    exec_run --set parallel.mode=fsdp --set 'devices.ids=[0]'
}
part_compile() {
    schema_has key:compile || skip "not available in this version (no train.compile)"
    [ "$DRY" = 1 ] && skip "dry run: inductor compiles for minutes on CPU"
    exec_run --set train.compile=true
}
part_parity() {
    runner parity --help >/dev/null 2>&1 || skip "not available in this version (no runner parity)"
    local modes=none,ddp steps=50
    [ "$NGPU" -ge 2 ] && modes=none,dp,ddp
    [ "$DRY" = 1 ] && steps=10
    (cd "$DETAIL/runs" && runner parity "$CHECK_SPEC" --modes "$modes" --steps "$steps")
}
part_memory() {  # runner plan's estimate per mode beside the peaks the runs above held (benchmarks/memory_check.py)
    (cd "$DETAIL/runs" && runner plan "$CHECK_SPEC" --json --set 'devices.ids=[0]') >"$DETAIL/plan.json" || return 1
    "$PY" "$REPO/benchmarks/memory_check.py" "$DETAIL/plan.json"
}
part_bench() {
    local modes=none,ddp nproc=1 steps=20 repeats=2:3
    [ "$ACCEL" = cuda ] && modes=none,dp,ddp
    [ "$NGPU" -ge 2 ] && nproc=1,2
    [ "$DRY" = 1 ] && modes=none steps=5 repeats=1:1  # ddp-1 rehearsed the launch already
    (cd "$DETAIL/runs" && runner bench "$CHECK_SPEC" --modes "$modes" --nproc "$nproc" --steps "$steps" \
        --repeats "$repeats" --out "$DETAIL") | tee "$DETAIL/bench.txt"
}
part_bench_recommend() {
    [ -s "$DETAIL/bench.txt" ] || skip "bench did not run"
    grep -i '^recommend' "$DETAIL/bench.txt" || skip "not available in this version (no recommendation line)"
}

# ---- the run ----------------------------------------------------------------------------------------------------
export -f runner exec_run schema_has skip install_kit kit_dry $(compgen -A function part_)
export PY DRY DETAIL SCRATCH KIT REPO NGPU ACCEL SPEC CHECK_SPEC=$DETAIL/runs/check.toml
echo "gpu_check: $([ "$DRY" = 1 ] && echo "dry run on CPU" || echo "$NGPU GPU(s)"), results in $OUT"
part kit 600
[ "$DRY" = 1 ] && PY=$SCRATCH/env/bin/python
if [ "$FAILED" = 1 ]; then
    echo "gpu_check: the kit did not install, so nothing else can run"
    printf '%s\n' "${ROWS[@]}" | tee "$OUT/summary.txt"
    exec >&- 2>&-
    wait "$TEE"
    exit 1
fi
export PYTHONPATH=$REPO:$SCRATCH/site
printf 'extends = "%s"\n\n[devices]\naccelerator = "%s"\n' "$SPEC" "$ACCEL" >"$CHECK_SPEC"
part import 120 show
part inventory 60 show
part cuda-tests 300
part none 150
part dp-1 150
part ddp-1 150
part amp-bf16 150
part amp-fp16 150
part sync-debug 150
if [ "$NGPU" -ge 2 ]; then
    part dp-2 150
    part ddp-2 180
else
    not_run dp-2 "needs 2 GPUs, $NGPU visible (one device runs dp unwrapped: no scatter, no gather)"
    not_run ddp-2 "needs 2 GPUs, $NGPU visible"
fi
part fsdp 180
part compile 240
part memory 120 show
part parity 240 show
part bench 300 show
part bench-recommend 10 show

{
    printf '%-16s %-34s %7s  %s\n' part result seconds note
    printf '%s\n' "${ROWS[@]}"
    echo "total $((SECONDS - START)) s; $([ "$FAILED" = 0 ] && echo "every part that ran passed" || echo "FAILED")"
} | tee "$OUT/summary.txt"
if [ "$BUNDLE" = 1 ]; then
    tar -czf "$OUT/gpu_check_detail.tar.gz" -C "$OUT" detail && rm -rf "$DETAIL"
fi
exec >&- 2>&-
wait "$TEE"  # the log is whole before the script returns
exit "$FAILED"
