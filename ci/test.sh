#!/usr/bin/env bash
# The README's test command: the suite's own tests and the conformance tests
# (fake tier and gloo pool, Hypothesis "ci" profile), two xdist workers.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
exec python -m pytest -n 2 --conformance-profile=ci "$@"
