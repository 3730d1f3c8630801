"""Standalone, torch-only reproduction scripts for a CaseSpec and its violations."""

from __future__ import annotations

import textwrap

from conformance.oracle import predict_fsdp1
from conformance.spec import (
    CaseSpec,
    CustomWrap,
    LambdaWrap,
    ModuleWrap,
    SizeBasedWrap,
    TransformerWrap,
    join,
    walk,
)

_TORCH = {"Module": "nn.Module", "Sequential": "nn.Sequential", "ModuleList": "nn.ModuleList", "ModuleDict": "nn.ModuleDict"}

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
    if "RANK" not in os.environ:  # plain `python`: a one-process gloo group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        show_pre_wrap_simulation()
    model, policy, kwargs = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fsdp = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), **kwargs)
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
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


def _policy_code(spec: CaseSpec, var: dict[str, str]) -> str:
    pol = spec.plan.policy
    if pol is None:
        return "policy = None"
    if isinstance(pol, ModuleWrap):
        return f"policy = ModuleWrapPolicy({{{', '.join(_cls(c) for c in pol.classes)}}})"
    if isinstance(pol, TransformerWrap):
        return f"policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={{{', '.join(_cls(c) for c in pol.classes)}}})"
    if isinstance(pol, SizeBasedWrap):
        return f"policy = functools.partial(size_based_auto_wrap_policy, min_num_params={pol.min_num_params})"
    targets = "[" + ", ".join(var[t] for t in pol.targets) + "]"
    if isinstance(pol, LambdaWrap):
        return f"targets = {targets}\npolicy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: any(m is t for t in targets))"
    assert isinstance(pol, CustomWrap)
    kw = {var[t]: dict(k) for t, k in pol.kwargs}
    kw_code = "{" + ", ".join(
        f"id({v}): {{" + ", ".join(f"{k!r}: " + (f"ShardingStrategy.{x}" if k == "sharding_strategy" else repr(x)) for k, x in d.items()) + "}"
        for v, d in kw.items()
    ) + "}"
    return (
        f"targets = {targets}\nkwargs = {kw_code}\n"
        "policy = CustomPolicy(lambda m: kwargs.get(id(m), True) if any(m is t for t in targets) else False)"
    )


def _cls(name: str) -> str:
    return {"Linear": "nn.Linear", "Embedding": "nn.Embedding", "LayerNorm": "nn.LayerNorm"}.get(name, _TORCH.get(name, name))


def model_lines(spec: CaseSpec) -> tuple[list[str], dict[str, str]]:
    """Torch-only statements that build the case's module tree (shared
    modules and ties included), and the variable of each spec path."""
    var = {path: f"m{i}" for i, (path, _) in enumerate(walk(spec.tree))}
    lines = ["torch.manual_seed(0)"]
    for path, m in walk(spec.tree):
        v = var[path]
        if m.cls == "Linear":
            w = m.params[0].shape
            ctor = f"nn.Linear({w[1]}, {w[0]}, bias={len(m.params) == 2})"
        elif m.cls == "Embedding":
            ctor = f"nn.Embedding{tuple(m.params[0].shape)}"
        elif m.cls == "LayerNorm":
            ctor = f"nn.LayerNorm({m.params[0].shape[0]})"
        else:
            ctor = f"{_cls(m.cls)}()"
        lines.append(f"{v} = {ctor}  # {path or '<root>'}")
        if path:
            parent = var[path.rpartition('.')[0]]
            lines.append(f"{parent}.add_module({m.name!r}, {v})")
        for p in m.params:
            if m.cls not in ("Linear", "Embedding", "LayerNorm"):
                lines.append(f"{v}.register_parameter({p.name!r}, nn.Parameter(torch.randn{tuple(p.shape)!r}))")
            if not p.requires_grad:
                lines.append(f"{v}.{p.name}.requires_grad_(False)")
        for b in m.buffers:
            lines.append(f"{v}.register_buffer({b.name!r}, torch.randn{tuple(b.shape)!r})")
    for s in spec.shared:
        lines.append(f"{var[s.parent]}.add_module({s.name!r}, {var[s.source]})  # shared module")
    for t in spec.ties:
        src_path, _, src_name = t.source.rpartition(".")
        lines.append(f"setattr({var[t.module]}, {t.name!r}, {var[src_path]}.{src_name})  # tied parameter")
    return lines, var


def build_code(spec: CaseSpec) -> str:
    """Source of `build()` returning (model, policy, kwargs), torch-only."""
    lines, var = model_lines(spec)
    lines.append(_policy_code(spec, var))
    kw = [f"use_orig_params={spec.plan.use_orig_params}"]
    if spec.plan.ignored_modules:
        kw.append("ignored_modules=[" + ", ".join(var[p] for p in spec.plan.ignored_modules) + "]")
    if spec.plan.ignored_params:
        kw.append("ignored_states=[" + ", ".join(f"m0.get_parameter({f!r})" for f in spec.plan.ignored_params) + "]")
    lines.append(f"return m0, policy, dict({', '.join(kw)})")
    return "def build():\n" + textwrap.indent("\n".join(lines), "    ") + "\n"


def class_code(spec: CaseSpec) -> str:
    out = []
    done = set(_TORCH)
    pending = list(spec.classes)
    while pending:
        c = next(c for c in pending if c.base in done)
        pending.remove(c)
        done.add(c.name)
        out.append(f"class {c.name}({_cls(c.base)}):\n    pass\n")
    return "\n\n".join(out)


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


# API -> fn(spec, violations, title) -> script: a torch-only generator for
# cases of that API (FSDP1's is below; another API registers its own).
GENERATORS: dict = {}


def repro_script(spec: CaseSpec, violations: list | None = None, title: str = "") -> str:
    """The standalone repro script of a case: torch-only where a generator
    exists for its API, else one that replays the case through this suite."""
    api = getattr(spec.plan, "api", "fsdp1")
    if getattr(spec, "schedule", None) is not None:  # --- training schedules (MP-DTYPES, ACCUM) ---
        from conformance.report.repro_schedule import schedule_script

        return schedule_script(spec, violations, title)
    gen = GENERATORS.get(api)
    # the torch-only generators build, wrap and call; they do not train: a
    # PARITY case replays through the suite
    if gen is not None and getattr(spec, "train", None) is None:
        return gen(spec, violations, title)
    return suite_script(spec, violations, title)


def suite_script(spec: CaseSpec, violations: list | None = None, title: str = "") -> str:
    """A script that replays the case with fsdp-conformance installed (for an
    API that has no torch-only generator yet): checks ``title``'s invariant,
    or every invariant of the case's API, on the fake tier or $BACKEND."""
    import torch

    head = [
        f"# fsdp-conformance reproduction{': ' + title if title else ''} ({spec.plan.api})",
        f"# found with torch {torch.__version__}",
        f"# no torch-only generator for API {spec.plan.api!r} yet: this script replays the case through fsdp-conformance",
    ]
    head += [f"# {v}" for v in violations or ()]
    head.append("# run: python repro.py   (BACKEND=gloo WORLD_SIZE=2 python repro.py for a rank pool)")
    inv = title if title and title.upper() == title and " " not in title else ""
    body = f'''
import os
import sys
import tempfile

from conformance.cli import main

CASE = {spec.to_json()!r}
INVARIANT = {inv!r}

if __name__ == "__main__":
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(CASE)
    args = ["check", f.name, "--backend", os.environ.get("BACKEND", "fake"), "--world-size", os.environ.get("WORLD_SIZE", "4")]
    sys.exit(main(args + (["--invariant", INVARIANT] if INVARIANT else [])))
'''
    return "\n".join(head) + "\n" + body


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
    parts = ["\n".join(head), imports, class_code(spec), build_code(spec), f"EXPECTED = {expected_text(spec)!r}\n", _OBSERVE]
    return "\n\n".join(p for p in parts if p.strip()).rstrip() + "\n"


GENERATORS["fsdp1"] = fsdp1_script


def _fsdp2_script(spec, violations=None, title=""):
    from conformance.report.repro_fsdp2 import fsdp2_script

    return fsdp2_script(spec, violations, title)


GENERATORS["fsdp2"] = _fsdp2_script
