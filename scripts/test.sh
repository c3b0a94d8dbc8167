#!/usr/bin/env bash
# Install everything the tests need into .venv, then run the whole suite (extra args go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --dev
exec .venv/bin/python -m pytest "$@"
