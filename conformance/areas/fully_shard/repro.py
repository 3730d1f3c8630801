"""Standalone, torch-only reproduction scripts for FSDP2 cases: fully_shard,
register_fsdp_forward_method and the drawn calls, against an unsharded copy."""

from __future__ import annotations

import textwrap

from conformance.areas.common.fsdp2_oracle import shard_order
from conformance.areas.common.repro import DEVICE_CODE, FSDP2_RUNTIME, class_code, model_lines
from conformance.case.build import SCALE, SHIFT
from conformance.case.graph import ModelGraph
from conformance.case.spec import CaseSpec, effective_calls
from conformance.case.tree import walk

_MAIN = '''
def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main():
    init_group()
    rank = dist.get_rank()
    model, mods = build()
    model.to(DEVICE)
    ref = copy.deepcopy(model)  # the unsharded reference (ties and methods copied along)
    ref_mods = {p: ref.get_submodule(p) for p in mods}
    shard(mods)
    register(mods)
    x = torch.linspace(-1.0, 1.0, 2, device=DEVICE)
    outs, ref_outs = [], []
    for i, (path, name, keyword) in enumerate(CALLS):
        args, kwargs = ((x, SHIFT), {"scale": SCALE}) if keyword else ((x,), {})
        fn = getattr(mods[path], name) if name else mods[path]
        ref_fn = getattr(ref_mods[path], name) if name else ref_mods[path]
        try:
            out = fn(*args, **kwargs)
        except Exception as e:
            print(f"[rank {rank}] call {i} {name or 'forward'} on {path or '<root>'!r} raised {type(e).__name__}: {e}")
            continue
        ref_out = ref_fn(*args, **kwargs)
        outs.append(out)
        ref_outs.append(ref_out)
        sharded = {p or "<root>": is_sharded(next(mods[p].parameters())) for p in GROUP_ROOTS if any(True for _ in mods[p].parameters())}
        print(f"[rank {rank}] call {i} {name or 'forward'} on {path or '<root>'!r}: max |out - reference| = "
              f"{(full(out) - ref_out).abs().max().item():.3g}; sharded after: {sharded}")
    if outs:
        try:
            sum((o ** 2).sum() for o in outs).backward()
            sum((o ** 2).sum() for o in ref_outs).backward()
            ref_params = dict(ref.named_parameters())
            for fqn, p in model.named_parameters():
                r = ref_params[fqn]
                if (p.grad is None) != (r.grad is None):
                    print(f"[rank {rank}] {fqn}: grad None is {p.grad is None}, the reference's {r.grad is None}")
                elif p.grad is not None:
                    d = (full(p.grad) - r.grad).abs().max().item()
                    if d > 1e-5:
                        print(f"[rank {rank}] gradient of {fqn} differs from the reference's by {d:.3g}")
        except Exception as e:
            print(f"[rank {rank}] backward raised {type(e).__name__}: {e}")
    end_group()


if __name__ == "__main__":
    main()
'''


def _method_code(i: int, name: str, steps) -> str:
    body = ["x = x + shift"]
    for st in steps:
        if st.op == "param":
            body.append(f"x = use_param(x, read_attr(self, {st.target!r}))")
        elif st.op == "child":
            body.append(f"x = call_child(read_attr(self, {st.target!r}), x)")
        elif st.op == "forward":
            body.append("x = self.forward(x)")
        else:
            body.append("x = self(x)")
    body.append("return x * scale")
    return f"def method{i}_{name}(self, x, shift=0.0, *, scale=1.0):\n" + textwrap.indent("\n".join(body), "    ") + "\n"


def fsdp2_script(spec: CaseSpec, violations: list | None = None, title: str = "") -> str:
    import torch

    head = [f"# fsdp-conformance reproduction (FSDP2){': ' + title if title else ''}", f"# found with torch {torch.__version__}"]
    head += [f"# {v}" for v in violations or ()]
    head.append("# run: python repro.py   or   torchrun --nproc-per-node 2 repro.py")
    imports = textwrap.dedent(
        """\
        import copy
        import os
        import socket
        import types

        import torch
        import torch.distributed as dist
        import torch.nn as nn
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh

        try:
            from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
        except ImportError:  # torch 2.4 - 2.5
            from torch.distributed._composable.fsdp import fully_shard, register_fsdp_forward_method
        """
    )
    lines, var = model_lines(spec)
    drawn = {c.name for c in spec.classes}
    graph = ModelGraph(spec)
    for path, m in walk(spec.tree):
        if m.cls in drawn:
            names = [n for n, _ in graph.nodes[path].params]
            lines.append(f"{var[path]}.case_params = {names!r}")
            lines.append(f"{var[path]}.case_buffers = {[b.name for b in m.buffers]!r}")
    for i, fm in enumerate(spec.methods):
        lines.append(f"{var[fm.module]}.{fm.name} = types.MethodType(method{i}_{fm.name}, {var[fm.module]})")
    lines.append("mods = {" + ", ".join(f"{p!r}: {v}" for p, v in var.items()) + "}")
    lines.append("return m0, mods")
    build = "def build():\n" + textwrap.indent("\n".join(lines), "    ") + "\n"
    order = shard_order(spec.plan, graph)
    shard_lines = []
    for grp in order:
        target = "[" + ", ".join(f"mods[{m!r}]" for m in grp.modules) + "]" if len(grp.modules) > 1 else f"mods[{grp.modules[0]!r}]"
        kw = "" if grp.reshard_after_forward is None else f", reshard_after_forward={grp.reshard_after_forward}"
        shard_lines.append(f"fully_shard({target}, mesh=mesh{kw})")
    shard_lines.insert(0, "mesh = init_device_mesh(DEVICE.type, (dist.get_world_size(),))")
    shard = "def shard(mods):\n    # bottom-up: each group after every group below it, the root last\n" + textwrap.indent("\n".join(shard_lines), "    ") + "\n"
    regs = [f"register_fsdp_forward_method(mods[{fm.module!r}], {fm.name!r})" for fm in spec.methods if fm.register]
    register = "def register(mods):\n" + textwrap.indent("\n".join(regs) or "pass", "    ") + "\n"
    calls = []
    for c in effective_calls(spec):
        for _ in range(c.times):
            if c.method == -1:
                calls.append(("", "", False))
            else:
                fm = spec.methods[c.method]
                calls.append((fm.module, fm.name, c.keyword))
    consts = (
        f"SHIFT, SCALE = {SHIFT!r}, {SCALE!r}\n"
        f"CALLS = {calls!r}  # (module path, method name or '' for forward, keyword arguments?)\n"
        f"GROUP_ROOTS = {[grp.modules[0] for grp in order]!r}\n"
    )
    classes = class_code(spec).replace("    pass\n", "    forward = generic_forward\n")
    methods = "\n\n".join(_method_code(i, fm.name, fm.steps) for i, fm in enumerate(spec.methods))
    parts = ["\n".join(head), imports, DEVICE_CODE, FSDP2_RUNTIME, classes, methods, build, shard, register, consts, _MAIN]
    return "\n\n".join(p.strip("\n") for p in parts if p.strip()) + "\n"
