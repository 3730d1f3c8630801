"""Mixed precision as a case names it (conformance.case.spec.Precision):
the FSDP1 ``mixed_precision`` kwarg or, for FSDP2, each group's
``mp_policy``. Adapters only (imports FSDP)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecision

from conformance.case.spec import CaseSpec, Precision


def dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def precision_api() -> tuple[type, type]:
    """(MixedPrecision, MixedPrecisionPolicy): public in torch.distributed.fsdp
    from 2.6, MixedPrecisionPolicy in torch.distributed._composable.fsdp before."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:  # torch 2.4, 2.5
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy
    return MixedPrecision, MixedPrecisionPolicy


def wrap_kwargs(spec: CaseSpec, pr: Precision | None):
    """FSDP1: the mixed_precision kwarg ({} without one); FSDP2: a function
    of a group's modules giving its mp_policy (output_dtype on the root's
    only: it casts the model's output, not every group's), or None."""
    MixedPrecision, MixedPrecisionPolicy = precision_api()
    if pr is None:
        return {} if spec.plan.api == "fsdp1" else None
    if spec.plan.api == "fsdp1":
        kw = dict(param_dtype=dtype(pr.param_dtype), reduce_dtype=dtype(pr.reduce_dtype), buffer_dtype=dtype(pr.buffer_dtype),
                  keep_low_precision_grads=pr.keep_low_precision_grads, cast_root_forward_inputs=pr.cast_root_forward_inputs)
        if pr.cast_forward_inputs is not None:
            kw["cast_forward_inputs"] = pr.cast_forward_inputs
        return {"mixed_precision": MixedPrecision(**kw)}

    def for_group(modules: tuple[str, ...]) -> dict:
        kw = dict(param_dtype=dtype(pr.param_dtype), reduce_dtype=dtype(pr.reduce_dtype))
        if pr.cast_forward_inputs is not None:
            kw["cast_forward_inputs"] = pr.cast_forward_inputs
        if modules == ("",) and pr.output_dtype:
            kw["output_dtype"] = dtype(pr.output_dtype)
        return {"mp_policy": MixedPrecisionPolicy(**kw)}

    return for_group
