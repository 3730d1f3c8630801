#!/usr/bin/env bash
# The README's test command: the suite's own tests and the conformance tests
# (fake tier, Hypothesis "ci" profile; the engine self-tests use the gloo pool), two xdist workers.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
exec python -m pytest -n 2 --conformance-profile=ci --tiers=fake "$@"
