#!/usr/bin/env bash
# After a run: compare its report with the committed baselines for its torch
# and tiers (the newest baseline at or below its torch release), write
# compare.md next to it, and append summary.md and compare.md to the GitHub
# job summary when there is one. Exit status: compare's (1 on a regression).
#   ci/summary.sh [REPORT_DIR] [BASELINE.json ...]
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
dir=${1:-reports/latest}
shift || true
rc=0
fsdp-conformance compare "$@" "$dir/report.json" --format md -o "$dir/compare.md" || rc=$?
if [ -n "${GITHUB_STEP_SUMMARY:-}" ]; then
  cat "$dir/summary.md" >> "$GITHUB_STEP_SUMMARY"
  [ -f "$dir/compare.md" ] && cat "$dir/compare.md" >> "$GITHUB_STEP_SUMMARY"
fi
exit "$rc"
