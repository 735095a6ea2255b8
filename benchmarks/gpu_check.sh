#!/usr/bin/env bash
# The prepared GPU check (issue 18): on a bare CUDA machine that holds only this repo
# and the wheels in .whl/, install them, run the GPU tests and a short benchmark, and
# leave a log and JSON in the output folder, within 8 minutes.
#
#   benchmarks/gpu_check.sh                 on the GPU machine (output: $OUT, else
#                                           results/gpu_check)
#   benchmarks/gpu_check.sh --dry-run       here, on the CPU: every step in a no-op mode
#   benchmarks/gpu_check.sh --fetch-wheels  download .whl/ (benchmarks/gpu_wheels.txt)
#   make gpu-check ARGS=--dry-run           the same through make
#
# Steps (each under its own time limit; one failing does not stop the others):
#   env        versions; the real run requires CUDA
#   install    real: pip install .whl/*.whl into /tmp/site (no index, no deps)
#              dry run: the wheel list is complete for Python 3.12 on x86-64 (each
#              wheel's needs met by a wheel or by the image, benchmarks/gpu_preinstalled.txt),
#              pip accepts every wheel for that platform, the upload fits 64 MiB
#   kernels    Triton kernels vs torch references, KV sizing      (dry run: collect only)
#   parity     greedy parity with transformers, bf16/fp16, graphs (dry run: collect only)
#   bench      benchmarks.gpu_bench                   (dry run: a toy model on the CPU)
#   imports    dry run only: everything the steps imported is carried or in the image
# Files in the output folder: gpu_check.log, gpu_check.json (the summary), steps.tsv,
# junit-kernels.xml, junit-parity.xml, bench.json.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
OUT_DIR=${OUT:-results/gpu_check}
while (($#)); do
    case $1 in
        --dry-run) DRY_RUN=1 ;;
        --out) OUT_DIR=$2; shift ;;
        --fetch-wheels) FETCH=1 ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done
if [[ -n ${PYTHON:-} ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi
if [[ -n ${FETCH:-} ]]; then exec "$PY" -m benchmarks.gpu_check_deps fetch; fi

KERNEL_TESTS=(
    tests/gpu/test_gpu_kernels.py
    tests/gpu/test_gpu_memory.py
    tests/kernels/test_attention_kernels.py::test_reshape_and_cache_matches_reference
    tests/kernels/test_attention_kernels.py::test_paged_attention_matches_reference
    tests/kernels/test_attention_kernels.py::test_paged_attention_half_precision
    tests/kernels/test_attention_kernels.py::test_paged_attention_shapes
    tests/kernels/test_attention_kernels.py::test_kernels_accept_strided_views
    tests/kernels/test_attention_kernels.py::test_paged_attention_reads_an_fp8_cache
    tests/kernels/test_lora_sgmv.py
)
PARITY_TESTS=(tests/gpu/test_gpu_parity.py)
SITE=/tmp/site
SCRIPT=$0
# The limits are the GPU machine's; a dry run on a shared CPU machine gets more time.
LIMIT_SCALE=$( ((DRY_RUN)) && echo 5 || echo 1)
# Nothing outside the GPU machine can be reached: never wait on the model hub.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DRY_RUN PY SITE SCRIPT

mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR"/{gpu_check.log,gpu_check.json,steps.tsv,junit-kernels.xml,junit-parity.xml,bench.json}
exec > >(tee -a "$OUT_DIR/gpu_check.log") 2>&1
RECORDS=$(mktemp -d)
trap 'rm -rf "$RECORDS"' EXIT

# step NAME SECONDS CMD...: run CMD (a program or a function of this script) under a
# time limit, note its exit status (124: stopped at the limit) and duration.
step() {
    local name=$1 limit=$(($2 * LIMIT_SCALE)) start_ms rc ms
    shift 2
    echo "=== $name (limit ${limit} s): $*"
    start_ms=$(date +%s%3N)
    if declare -F "$1" >/dev/null; then
        timeout --kill-after=10 "$limit" bash -c "$(declare -f "$1"); $*"
    else
        timeout --kill-after=10 "$limit" "$@"
    fi
    rc=$?
    ms=$(($(date +%s%3N) - start_ms))
    printf '%s\t%d\t%d.%03d\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) >>"$OUT_DIR/steps.tsv"
    echo "=== $name: exit $rc after $((ms / 1000)) s"
    return 0
}

# The dry run runs Python steps under a recorder of what they import.
python_step() {
    local name=$1 limit=$2
    shift 2
    if ((DRY_RUN)); then
        # Without this machine's pytest plugins, which the GPU machine does not have.
        PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 \
            step "$name" "$limit" "$PY" -m benchmarks.gpu_check_deps record "$RECORDS/$name.json" "$@"
    else
        step "$name" "$limit" "$PY" "$@"
    fi
}

env_check() {
    bash -n "$SCRIPT" || return 1
    nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
    "$PY" - "$DRY_RUN" <<'EOF'
import platform, sys
import torch
print(f"python {platform.python_version()} {platform.machine()}, torch {torch.__version__}, "
      f"cuda {torch.version.cuda}, device: "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
for name in ("triton", "transformers", "flash_attn"):
    try:
        print(f"{name} {__import__(name).__version__}")
    except ImportError:
        print(f"{name}: not installed")
sys.exit(0 if sys.argv[1] == "1" or torch.cuda.is_available() else "no CUDA device")
EOF
}

install_wheels() {
    if ((DRY_RUN)); then
        local target
        target=$(mktemp -d)
        "$PY" -m benchmarks.gpu_check_deps check-wheels || return 1
        # shellcheck disable=SC2046
        "$PY" -m pip install -q --dry-run --no-index --no-deps --ignore-installed \
            --target "$target" $("$PY" -c 'from benchmarks.gpu_check_deps import pip_platform_args
print(" ".join(pip_platform_args()))') .whl/*.whl || return 1
        echo "pip: every wheel installs on CPython 3.12, manylinux x86-64"
        rm -rf "$target"
        "$PY" -m benchmarks.gpu_check_deps travel-size
    else
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl
    fi
}

pytest_args() {  # NAME: the pytest arguments of a test step
    if ((DRY_RUN)); then
        echo "-m pytest -q -p no:cacheprovider --collect-only"
    else
        echo "-m pytest -v -p no:cacheprovider -rs --durations=10 --junitxml=$OUT_DIR/junit-$1.xml"
    fi
}

echo "gpu check$( ((DRY_RUN)) && echo ' (dry run)') in $PWD -> $OUT_DIR, python $PY, $(date -u)"
# Limits sum to 480 s (8 minutes); a step that reaches its limit is stopped (exit 124) and
# the next one runs. Pytest runs verbose, so a stopped step's log still names each result.
step env 20 env_check
step install 40 install_wheels
if ((!DRY_RUN)); then
    export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# shellcheck disable=SC2046
python_step kernels 140 $(pytest_args kernels) "${KERNEL_TESTS[@]}"
# shellcheck disable=SC2046
python_step parity 180 $(pytest_args parity) "${PARITY_TESTS[@]}"
if ((DRY_RUN)); then
    python_step bench 100 -m benchmarks.gpu_bench --dry-run --out "$OUT_DIR/bench.json"
    step imports 30 "$PY" -m benchmarks.gpu_check_deps check-imports "$RECORDS"/*.json
else
    python_step bench 100 -m benchmarks.gpu_bench --out "$OUT_DIR/bench.json"
fi
dry_flag=()
((DRY_RUN)) && dry_flag=(--dry-run)
"$PY" -m benchmarks.gpu_check_summary "$OUT_DIR" "${dry_flag[@]}"
