#!/usr/bin/env bash
# The prepared NCCL check: on a machine with GPUs and no network,
# run the suite's nccl tier (world size = the number of GPUs) for a few
# minutes, then one FSDP1 and one FSDP2 repro script under torchrun with NCCL.
# Run from the repository root:   bash ci/nccl_check.sh
# Writes the log and the report (JSON + Markdown) to $OUT when set.
#   NCCL_CHECK_BACKEND=gloo   rehearse the whole script on CPU (gloo instead of nccl)
#   NCCL_CHECK_EXAMPLES=15    examples per invariant     NCCL_CHECK_WORKERS=4  pytest-xdist workers
#   NCCL_CHECK_MINUTES=4      time limit of the suite run (the repros get 1 more minute)
# Never part of CI: CI has no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
BACKEND=${NCCL_CHECK_BACKEND:-nccl}
EXAMPLES=${NCCL_CHECK_EXAMPLES:-15}
WORKERS=${NCCL_CHECK_WORKERS:-4}
MINUTES=${NCCL_CHECK_MINUTES:-4}
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nccl-check.XXXXXX")
LOG=$WORK/nccl_check.log
export PYTHONUNBUFFERED=1

check() {
echo "== machine"
date -u
if command -v nvidia-smi > /dev/null; then nvidia-smi -L; else echo "no nvidia-smi"; fi
"$PY" -c 'import sys, torch, torch.distributed as dist
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda, "| GPUs", torch.cuda.device_count())
print("NCCL", torch.cuda.nccl.version() if dist.is_nccl_available() and torch.cuda.is_available() else "-", "| nccl available", dist.is_nccl_available())'

echo "== dependencies (no network: wheels in .whl/ are installed when a module is missing)"
missing=$("$PY" -c 'import importlib.util as u
print(" ".join(m for m in ("hypothesis", "pytest", "xdist", "expecttest", "packaging", "jinja2", "rich", "numpy") if u.find_spec(m) is None))')
if [ -n "$missing" ] && ls .whl/*.whl > /dev/null 2>&1; then
  echo "missing: $missing; installing .whl/*.whl"
  "$PY" -m pip install -q --no-index --no-deps --user --break-system-packages .whl/*.whl 2> /dev/null \
    || "$PY" -m pip install -q --no-index --no-deps .whl/*.whl
  missing=$("$PY" -c 'import importlib.util as u
print(" ".join(m for m in ("hypothesis", "pytest", "xdist", "expecttest", "packaging", "jinja2", "rich", "numpy") if u.find_spec(m) is None))')
fi
if [ -n "$missing" ]; then
  # expecttest: torch.testing._internal.common_utils imports it, and the
  # suite's Hypothesis profile setup imports that module: nothing runs without it
  echo "nccl_check: missing Python modules: $missing (put their wheels in .whl/, e.g. pip download --no-deps expecttest -d .whl)"
  return 2
fi

# The checkout itself, without installing: the package on PYTHONPATH, the
# pytest plugin by -p unless an installed copy registers it already.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PLUGIN=(-p conformance.plugin)
if "$PY" -c 'import importlib.metadata as m, sys; sys.exit(0 if any(e.value == "conformance.plugin" for e in m.entry_points(group="pytest11")) else 1)'; then
  PLUGIN=()
fi

if [ "$BACKEND" = nccl ]; then
  WORLD=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
  if [ "$WORLD" -lt 1 ]; then echo "nccl_check: no GPU visible"; return 2; fi
else
  WORLD=${NCCL_CHECK_WORLD:-1}
fi

echo "== suite: --backend $BACKEND --world-size $WORLD --profile ci --examples $EXAMPLES -n $WORKERS (limit ${MINUTES} min)"
start=$(date +%s)
timeout --signal=INT --kill-after=30 "$((MINUTES * 60))" \
  "$PY" -m conformance.cli run --backend "$BACKEND" --world-size "$WORLD" --profile ci --examples "$EXAMPLES" \
  -n "$WORKERS" --progress quiet --report-dir "$WORK/report" -- "${PLUGIN[@]}"
rc=$?
echo "== suite exit code $rc ($(( $(date +%s) - start )) s)"

echo "== repro scripts under torchrun --nproc-per-node $WORLD, FSDP_REPRO_BACKEND=$BACKEND"
"$PY" - "$WORK" <<'EOF'
import dataclasses, sys
from conformance.case.examples import lora_model
from conformance.areas.autowrap.repro import fsdp1_script
from conformance.areas.fully_shard.repro import fsdp2_script
from conformance.case.spec import WrapPlan

spec = lora_model(num_layers=2, dim=8, rank=2, use_orig_params=True)  # wraps (mixed units warn)
open(f"{sys.argv[1]}/repro_fsdp1.py", "w").write(fsdp1_script(spec, title="nccl check"))
spec2 = dataclasses.replace(spec, plan=WrapPlan(api="fsdp2"))
open(f"{sys.argv[1]}/repro_fsdp2.py", "w").write(fsdp2_script(spec2, title="nccl check"))
EOF
for api in fsdp1 fsdp2; do
  FSDP_REPRO_BACKEND=$BACKEND timeout --kill-after=10 45 "$PY" -m torch.distributed.run --nproc-per-node "$WORLD" \
    --standalone "$WORK/repro_$api.py"
  echo "== repro $api exit code $?"
done

return "$rc"
}

check 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  cp "$LOG" "$OUT/"
  for f in report.json summary.md junit.xml; do
    [ -f "$WORK/report/$f" ] && cp "$WORK/report/$f" "$OUT/"
  done
  for f in repro_fsdp1.py repro_fsdp2.py; do
    [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"
  done
  echo "copied to $OUT: $(ls "$OUT" | tr '\n' ' ')"
fi
echo "nccl_check: exit $rc (work folder $WORK)"
exit "$rc"
