#!/usr/bin/env bash
# Nightly hunt: fresh random examples on the fake tier and the gloo pool for
# $MINUTES (default 30), the finds kept in the example database $DATABASE
# (default .fsdp-conformance-db; in the workflow, github:OWNER/REPO: the
# previous nights' finds, read from the uploaded artifact, replay first).
# Exit 1 on an unexplained failure, 2 when the hunt could not run.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
dir=${REPORT_DIR:-reports/hunt}
rc=0
fsdp-conformance hunt --minutes "${MINUTES:-30}" --tiers "${TIERS:-fake,gloo}" -n "${WORKERS:-2}" \
  --database "${DATABASE:-.fsdp-conformance-db}" --report-dir "$dir" "$@" || rc=$?
if [ -n "${GITHUB_STEP_SUMMARY:-}" ] && [ -f "$dir/summary.md" ]; then
  cat "$dir/summary.md" >> "$GITHUB_STEP_SUMMARY"
fi
exit "$rc"
