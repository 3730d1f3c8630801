"""Standalone, torch-only reproduction scripts for FSDP1 cases: build the case,
wrap it with FullyShardedDataParallel, print what FSDP did next to what the
spec says it must do."""

from __future__ import annotations

import textwrap

from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from conformance.areas.common.repro import DEVICE_CODE, class_code, model_lines, policy_code
from conformance.case.spec import CaseSpec

_OBSERVE = '''
def show_pre_wrap_simulation():
    """What torch's helpers behind _validate_frozen_params say each unit will manage."""
    from torch.distributed.fsdp._wrap_utils import _get_managed_param_to_fqn, _get_post_order_named_modules

    model, policy, kwargs = build()
    if not hasattr(policy, "_run_policy"):
        return  # callable policies are not simulated by torch
    ignored = {p for m in kwargs.get("ignored_modules", []) for p in m.parameters()} | set(kwargs.get("ignored_states", []))
    targets = set(policy._run_policy(model, set(kwargs.get("ignored_modules", [])), {})) | {model}
    visited = set()
    for name, module in _get_post_order_named_modules(model):
        if module in targets:
            managed = _get_managed_param_to_fqn(module, ignored, visited, name)
            print(f"pre-wrap simulation: unit {name or '<root>'!r} would manage {list(managed.values())}")


def main():
    init_group()
    if dist.get_rank() == 0:
        show_pre_wrap_simulation()
    model, policy, kwargs = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fsdp = FSDP(model, auto_wrap_policy=policy, device_id=DEVICE, **kwargs)
        except Exception as e:
            fsdp = None
            print(f"FSDP raised {type(e).__name__}: {e}")
    for w in caught:
        print(f"{w.category.__name__}: {w.message}")
    if fsdp is not None:
        units = []
        for name, unit in fsdp.named_modules():
            if isinstance(unit, FSDP):
                name = name.replace("_fsdp_wrapped_module.", "").replace("._fsdp_wrapped_module", "")
                units.append((name, list(unit._handle.flat_param._fqns) if unit._handle else []))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, units)
        if dist.get_rank() == 0:
            for rank, rank_units in enumerate(everyone):
                for name, fqns in rank_units:
                    print(f"[rank {rank}] FSDP unit {name or '<root>'!r} manages {fqns}")
        if all(u == units for u in everyone):  # else state_dict's collectives would mismatch
            keys = [k.replace("_fsdp_wrapped_module.", "") for k in fsdp.state_dict()]
            if dist.get_rank() == 0:
                print("state_dict keys:", keys)
        elif dist.get_rank() == 0:
            print("the ranks built DIFFERENT FSDP units")
    if dist.get_rank() == 0:
        print(EXPECTED)
    end_group()


if __name__ == "__main__":
    main()
'''


def build_code(spec: CaseSpec) -> str:
    """Source of `build()` returning (model, policy, kwargs), torch-only."""
    lines, var = model_lines(spec)
    lines.append(policy_code(spec, var))
    kw = [f"use_orig_params={spec.plan.use_orig_params}"]
    if spec.plan.ignored_modules:
        kw.append("ignored_modules=[" + ", ".join(var[p] for p in spec.plan.ignored_modules) + "]")
    if spec.plan.ignored_params:
        kw.append("ignored_states=[" + ", ".join(f"m0.get_parameter({f!r})" for f in spec.plan.ignored_params) + "]")
    lines.append(f"return m0, policy, dict({', '.join(kw)})")
    return "def build():\n" + textwrap.indent("\n".join(lines), "    ") + "\n"


def expected_text(spec: CaseSpec) -> str:
    pred = predict_fsdp1(spec)
    lines = ["Expected (the oracle, from the FSDP spec):"]
    if pred.error is not None:
        u = pred.error
        lines.append(f"  ValueError naming {u.path or '<root>'}: trainable {list(u.trainable)}, frozen {list(u.frozen)}")
    else:
        for u in pred.units:
            lines.append(f"  FSDP unit {u.path or '<root>'!r} manages {list(u.managed)}")
        for u in pred.warnings:
            lines.append(f"  UserWarning for {u.path or '<root>'}: {u.total_numel} numel instead of {u.trainable_numel}")
        for t in pred.ties:
            if t.below_lca:
                lines.append(f"  an error: tied {t.fqn} would live in unit {t.unit or '<root>'}, below the common ancestor {t.lca or '<root>'}")
    return "\n".join(lines)


def fsdp1_script(spec: CaseSpec, violations: list | None = None, title: str = "") -> str:
    """A torch-only script that builds the case, wraps it with FSDP1 and
    prints what FSDP did next to what the spec says it must do."""
    import torch

    head = [f"# fsdp-conformance reproduction{': ' + title if title else ''}", f"# found with torch {torch.__version__}"]
    for v in violations or ():
        head.append(f"# {v}")
    head.append("# run: python repro.py   or   torchrun --nproc-per-node 2 repro.py")
    imports = textwrap.dedent(
        """\
        import functools
        import os
        import socket
        import warnings

        import torch
        import torch.distributed as dist
        import torch.nn as nn
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from torch.distributed.fsdp.wrap import (
            CustomPolicy,
            ModuleWrapPolicy,
            lambda_auto_wrap_policy,
            size_based_auto_wrap_policy,
            transformer_auto_wrap_policy,
        )
        """
    )
    parts = ["\n".join(head), imports, DEVICE_CODE, class_code(spec), build_code(spec), f"EXPECTED = {expected_text(spec)!r}\n", _OBSERVE]
    return "\n\n".join(p for p in parts if p.strip()).rstrip() + "\n"
