"""Standalone, torch-only reproduction scripts for FSDP2 cases: fully_shard,
register_fsdp_forward_method and the drawn calls, against an unsharded copy."""

from __future__ import annotations

import textwrap

from conformance.areas.common.fsdp2_oracle import predict_fsdp2, shard_order
from conformance.areas.common.repro import DEFAULT_MODES, FSDP2_RUNTIME, HARNESS, assemble, class_code, header, model_lines
from conformance.case.build import SCALE, SHIFT
from conformance.case.graph import ModelGraph
from conformance.case.spec import CaseSpec, effective_calls
from conformance.case.tree import walk

_MAIN = '''
def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main():
    init()
    rank = dist.get_rank()
    model, mods = build()
    model.to(DEVICE)
    ref = copy.deepcopy(model)  # the unsharded reference (ties and methods copied along)
    ref_mods = {p: ref.get_submodule(p) for p in mods}
    try:
        shard(mods)
        register(mods)
    except Exception as e:
        if isinstance(e, ValueError) and REJECT_OK:  # the split tie rejected, naming it: as specified
            return finish(None, f"fully_shard rejected the split tie: {str(e).splitlines()[0]}")
        return finish(f"[rank {rank}] fully_shard raised {type(e).__name__}: {str(e).splitlines()[0]}", None)
    wrong = []
    x = torch.linspace(-1.0, 1.0, 2, device=DEVICE)
    outs, ref_outs = [], []
    for i, ((path, name, keyword), (exact, sharded_after)) in enumerate(zip(CALLS, EXPECTED)):
        args, kwargs = ((x, SHIFT), {"scale": SCALE}) if keyword else ((x,), {})
        where = f"call {i} ({name or 'forward'} on {path or '<root>'})"
        try:
            out = (getattr(mods[path], name) if name else mods[path])(*args, **kwargs)
        except Exception as e:
            wrong.append(f"[rank {rank}] {where} raised {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        ref_out = (getattr(ref_mods[path], name) if name else ref_mods[path])(*args, **kwargs)
        outs.append(out)
        ref_outs.append(ref_out)
        d = (full(out) - ref_out).abs().max().item()
        if exact and d > 1e-5:
            wrong.append(f"[rank {rank}] {where}: output differs from the unsharded reference's by {d:.3g}")
        for p, want in sharded_after.items():
            got = is_sharded(next(mods[p].parameters()))
            if got != want:
                wrong.append(f"[rank {rank}] after {where} group {p or '<root>'} is {'sharded' if got else 'unsharded'}, expected "
                             f"{'sharded' if want else 'unsharded'}")
    if outs and BACKWARD and not wrong:
        try:
            sum((o ** 2).sum() for o in outs).backward()
            sum((o ** 2).sum() for o in ref_outs).backward()
            ref_params = dict(ref.named_parameters())
            for fqn, p in model.named_parameters():
                r = ref_params[fqn]
                if (p.grad is None) != (r.grad is None):
                    wrong.append(f"[rank {rank}] {fqn}.grad is {'None' if p.grad is None else 'set'}, the reference's "
                                 f"{'None' if r.grad is None else 'set'}")
                elif p.grad is not None and (d := (full(p.grad) - r.grad).abs().max().item()) > 1e-5:
                    wrong.append(f"[rank {rank}] the gradient of {fqn} differs from the reference's by {d:.3g}")
        except Exception as e:
            wrong.append(f"[rank {rank}] backward raised {type(e).__name__}: {str(e).splitlines()[0]}")
    finish("; ".join(wrong) or None, "every call's output, reshard state and gradients are as the unsharded reference's")


if __name__ == "__main__":
    main()
'''


def graph_params(graph: ModelGraph, path: str):
    """The parameters a module's subtree holds (a group without any has no reshard state to look at)."""
    nid = graph.resolve_module(path)
    return graph.subtree_params(nid)


def _expected_text(pred) -> str:
    if pred.supported:
        return f"Outside what FSDP2 promises ({pred.supported}): the script reports what it sees, checks nothing."
    return ("Expected (the oracle): each call's output equal to the unsharded reference's where every parameter it reads is unsharded, "
            "each group sharded or not after a call as reshard_after_forward says" + (", the gradients as the reference's." if pred.backward_promised else "."))


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


def fsdp2_script(spec: CaseSpec, violations: list | None = None, title: str = "", *, modes=DEFAULT_MODES, finding: str = "",
                 name: str = "repro.py") -> str:
    """A torch-only script that shards the case with fully_shard, makes its
    calls next to an unsharded copy, compares outputs, reshard states and
    gradients with what the oracle promises, and prints the verdict."""
    import torch

    pred = predict_fsdp2(spec, torch.__version__)
    imports = ["import copy", "import os", "import socket"]
    if spec.methods:
        imports.append("import types")
    imports += ["", "import torch", "import torch.distributed as dist", "import torch.nn as nn", "import torch.nn.functional as F",
                "from torch.distributed.device_mesh import init_device_mesh"]
    fs = "fully_shard, register_fsdp_forward_method" if any(fm.register for fm in spec.methods) else "fully_shard"
    imports += ["", "try:", f"    from torch.distributed.fsdp import {fs}", "except ImportError:  # torch 2.4 - 2.5",
                f"    from torch.distributed._composable.fsdp import {fs}"]
    imports = "\n".join(imports)
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
    roots = [grp.modules[0] for grp in order]
    expected = [(c.in_promise and not pred.supported,
                 {roots[g]: s for g, s in enumerate(c.sharded_after) if s is not None and g < len(roots) and any(True for _ in graph_params(graph, roots[g]))}
                 if not pred.supported else {})
                for c in pred.calls]
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
        f"# the oracle, per call: (its output must equal the reference's, {{group: sharded after it}})\n"
        f"EXPECTED = {expected!r}\n"
        f"BACKWARD = {pred.backward_promised and not pred.supported}  # gradients as the reference's are promised\n"
        f"REJECT_OK = {'error' in pred.tie_outcomes}  # a ValueError naming a split tie is as specified\n"
    )
    classes = class_code(spec).replace("    pass\n", "    forward = generic_forward\n")
    methods = "\n\n".join(_method_code(i, fm.name, fm.steps) for i, fm in enumerate(spec.methods))
    doc = header(f"(FSDP2) {title}" if title else "(FSDP2)", violations, _expected_text(pred), modes, finding, name)
    return assemble(doc, imports, [HARNESS, FSDP2_RUNTIME, classes, methods, build, shard, register, consts, _MAIN])
