"""FSDP1 and user forward methods: the summon_full_params(recurse=False)
workaround of spec source 004 (FSDP1 has no register_fsdp_forward_method)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from conformance.areas.common.fsdp1_adapter import wrap
from conformance.areas.common.fsdp2_adapter import error_line
from conformance.areas.common.observation import CallObservation
from conformance.areas.common.support import placed
from conformance.areas.common.training import FORWARD_ATOL, FORWARD_RTOL
from conformance.areas.summon.observation import SummonObservation
from conformance.case.build import build, call_args, method_callable
from conformance.case.spec import CaseSpec, effective_calls


def observe(spec: CaseSpec) -> SummonObservation:
    """Wrap with FSDP1; run each root forward as is and each method inside
    summon_full_params(model, writeback=False, recurse=False), without
    gradients (the generate() use case), against the unwrapped reference
    (not on the fake tier, whose collectives carry no data: there only
    whether a call raises is observed)."""
    base = dict(api="fsdp1", rank=dist.get_rank(), world_size=dist.get_world_size(),
                backend=str(dist.get_backend()), torch_version=torch.__version__)
    fake = base["backend"] == "fake"
    built = placed(build(spec))
    ref = None if fake else placed(build(spec))
    t0 = time.perf_counter()
    try:
        model = wrap(spec, built)
    except Exception as e:
        return SummonObservation(**base, wrap_error=error_line(e))
    calls = []
    index = 0
    ref_seconds = 0.0  # the unwrapped reference's calls: not FSDP's time
    with torch.no_grad():
        for call in effective_calls(spec):
            for _ in range(call.times):
                args, kwargs = call_args(built.example_input(), call)
                try:
                    if call.method == -1:
                        out = model(*args, **kwargs)
                    else:
                        with FSDP.summon_full_params(model, writeback=False, recurse=False):
                            out = method_callable(model, spec, call.method)(*args, **kwargs)
                except Exception as e:
                    calls.append(CallObservation(index, call.method, 0, None, None, error_line(e), ()))
                    return SummonObservation(**base, calls=tuple(calls), seconds=time.perf_counter() - t0 - ref_seconds)
                close, diff = None, None
                if ref is not None:
                    t_ref = time.perf_counter()
                    want = method_callable(ref.model, spec, call.method)(*args, **kwargs)
                    ref_seconds += time.perf_counter() - t_ref
                    ok = out.shape == want.shape
                    diff = float((out - want).abs().max()) if ok else float("inf")
                    close = ok and bool(torch.allclose(out, want, rtol=FORWARD_RTOL, atol=FORWARD_ATOL))
                calls.append(CallObservation(index, call.method, 0, close, diff, None, ()))
                index += 1
    return SummonObservation(**base, calls=tuple(calls), seconds=time.perf_counter() - t0 - ref_seconds)
