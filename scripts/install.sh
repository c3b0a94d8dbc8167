#!/usr/bin/env bash
# Create .venv and install the pinned dependencies (add --dev for tests and benchmarks).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
requirements=requirements.txt
[ "${1:-}" = "--dev" ] && requirements=requirements-dev.txt
.venv/bin/python -m pip install -qq --disable-pip-version-check -r "$requirements"
if [ "${1:-}" = "--dev" ]; then
  # Qwen3's published chat template, the reference the chat-template tests render against.
  .venv/bin/python -m tests.published_template
fi
