#!/usr/bin/env bash
# Nightly torch: the conformance run on the gloo pool (W=2, "ci" profile) with
# its report in reports/latest, compared with the newest committed baseline.
# Fails on a regression against that baseline (or when the run cannot start);
# a FAIL that the baseline had too is in the report, not a failure here.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
dir=${REPORT_DIR:-reports/latest}
run=0
fsdp-conformance run --profile "${PROFILE:-ci}" --backend gloo --world-size "${WORLD_SIZE:-2}" -n "${WORKERS:-2}" \
  --report-dir "$dir" --baseline none "$@" || run=$?
[ "$run" -le 1 ] || exit "$run"
bash ci/summary.sh "$dir"
