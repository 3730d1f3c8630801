#!/usr/bin/env bash
# Multi-GPU runner: world size = the GPUs on the machine (or $WORLD_SIZE).
# 1. NCCL through torchrun: every rank runs the same drawn cases and rank 0
#    checks that the ranks agree (python -m conformance.engine.torchrun);
# 2. the conformance suite on a pool of NCCL ranks, with its report and the
#    baseline compare.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
dir=${REPORT_DIR:-reports/latest}
mkdir -p "$dir"
n=${WORLD_SIZE:-$(python -c "import torch; print(torch.cuda.device_count())")}
if [ "$n" -lt 1 ]; then echo "ci/gpu.sh: no GPUs on this machine" >&2; exit 2; fi
python ci/draw_specs.py --examples "${EXAMPLES:-200}" -o "$dir/specs.jsonl"
torchrun --standalone --nproc-per-node "$n" -m conformance.engine.torchrun \
  --backend nccl --specs "$dir/specs.jsonl" --out "$dir/torchrun.jsonl"
run=0
fsdp-conformance run --profile "${PROFILE:-ci}" --backend nccl --world-size "$n" --report-dir "$dir" "$@" || run=$?
[ "$run" -le 1 ] || exit "$run"
cmp=0
bash ci/summary.sh "$dir" || cmp=$?
exit $(( run > cmp ? run : cmp ))
