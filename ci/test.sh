#!/usr/bin/env bash
# The README's test command: the layering contracts (import-linter) and the
# linter (ruff), then the suite's own tests and the conformance tests (fake
# tier and gloo pool, Hypothesis "ci" profile), two xdist workers.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
lint-imports
ruff check --no-cache conformance strategies tests ci
exec python -m pytest -n 2 --dist worksteal --conformance-profile=ci "$@"
