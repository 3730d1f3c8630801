#!/usr/bin/env bash
# Regenerate the committed baselines for the installed torch: the conformance
# suite on the fake tier (W=4) and on the gloo pool (W=2), Hypothesis "ci"
# profile (derandomized), written to
# reports/baselines/torch-<release>-<backend>-w<W>.json. A baseline records what
# the run found: FAIL rows included.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
WORKERS=${WORKERS:-2}
release=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
for tier in "fake 4" "gloo 2"; do
  set -- $tier
  backend=$1 world=$2
  dir=$(mktemp -d)
  if [ "$backend" = fake ]; then size=(--fake-world-size "$world"); else size=(--world-size "$world"); fi
  rc=0
  "$PY" -m conformance.cli run --profile ci --backend "$backend" "${size[@]}" -n "$WORKERS" \
    --report-dir "$dir" --baseline none --progress quiet > "$dir/run.log" 2>&1 || rc=$?
  tail -n 3 "$dir/run.log"
  if [ "$rc" -gt 1 ]; then echo "baseline run failed (exit $rc): $dir/run.log" >&2; exit "$rc"; fi
  out=reports/baselines/torch-$release-$backend-w$world.json
  cp "$dir/report.json" "$out"
  echo "wrote $out"
done
