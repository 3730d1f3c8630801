#!/usr/bin/env bash
# The README's test command: the layering contracts (import-linter) and the
# linter (ruff), then the suite's own tests and the conformance tests (fake
# tier and gloo pool, Hypothesis "ci" profile), two xdist workers.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
# Bytecode caching on: a machine-wide PYTHONDONTWRITEBYTECODE=1 makes every
# process of the run (pytest, its xdist workers, each CLI run and rank pool)
# compile the suite's ~230 modules from source again, and pytest re-rewrite
# the asserts of the package its plugin lives in: about 1.6 CPU-s per pytest
# process measured here. The caches go to __pycache__ (ignored by git).
unset PYTHONDONTWRITEBYTECODE
lint-imports
ruff check --no-cache conformance strategies tests ci
exec python -m pytest -n 2 --dist worksteal --conformance-profile=ci "$@"
