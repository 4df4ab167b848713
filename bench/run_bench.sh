#!/usr/bin/env bash
# The policies side by side against the physical limit, in one run (bench/policies.py):
#   bench/run_bench.sh [--quick] [--concurrency 16] [--json PATH]
# LLAMA_SERVER=/path/to/llama-server adds llama.cpp's own server as a peer column
# (bench/README.md: how to build it). wrk (Debian package `wrk`) adds the non-streamed driver.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
exec "$PY" -m bench.policies "$@"
