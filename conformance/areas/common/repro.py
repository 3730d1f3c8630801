"""What every API's repro script shares: torch-only code that builds a case's
module tree (shared modules and ties included) and its classes."""

from __future__ import annotations

import torch

from conformance.case.spec import CaseSpec, CustomWrap, LambdaWrap, ModuleWrap, SizeBasedWrap, TransformerWrap
from conformance.case.tree import walk

# The backend and device a repro script runs on, chosen by an environment
# variable so that the same script runs on CPU (gloo, the default) and on GPUs.
DEVICE_CODE = '''
# FSDP_REPRO_BACKEND=nccl: every rank on its GPU (cuda:LOCAL_RANK); default gloo, on CPU
BACKEND = os.environ.get("FSDP_REPRO_BACKEND", "gloo")
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if BACKEND == "nccl" else torch.device("cpu")


def init_group():
    if "RANK" not in os.environ:  # plain `python`: a one-process group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(BACKEND)


def end_group():
    """Every rank leaves here: a barrier, then exit without tearing the group
    down (gloo's teardown can abort a rank now and then: "terminate called
    without an active exception")."""
    import sys

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
'''

_TORCH = {"Module": "nn.Module", "Sequential": "nn.Sequential", "ModuleList": "nn.ModuleList", "ModuleDict": "nn.ModuleDict"}


def class_ref(name: str) -> str:
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
            ctor = f"{class_ref(m.cls)}()"
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


def class_code(spec: CaseSpec) -> str:
    out = []
    done = set(_TORCH)
    pending = list(spec.classes)
    while pending:
        c = next(c for c in pending if c.base in done)
        pending.remove(c)
        done.add(c.name)
        out.append(f"class {c.name}({class_ref(c.base)}):\n    pass\n")
    return "\n\n".join(out)


def suite_script(spec: CaseSpec, violations: list | None = None, title: str = "") -> str:
    """A script that replays the case with fsdp-conformance installed (for an
    API that has no torch-only generator yet): checks ``title``'s invariant,
    or every invariant of the case's API, on the fake tier or $BACKEND."""
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


def policy_code(spec: CaseSpec, var: dict[str, str]) -> str:
    pol = spec.plan.policy
    if pol is None:
        return "policy = None"
    if isinstance(pol, ModuleWrap):
        return f"policy = ModuleWrapPolicy({{{', '.join(class_ref(c) for c in pol.classes)}}})"
    if isinstance(pol, TransformerWrap):
        return f"policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={{{', '.join(class_ref(c) for c in pol.classes)}}})"
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


# The case's forward and helpers, as conformance/build.py defines them.
FSDP2_RUNTIME = '''
def read_attr(obj, path):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def is_sharded(t):
    return hasattr(t, "device_mesh")  # a DTensor: FSDP2's sharded parameter


def use_param(x, t):
    if t.dim() == 2:  # a head reusing a weight through F.linear (HF generate()'s tied head)
        return F.linear(x[:, None].expand(x.shape[0], t.shape[1]), t).mean(-1) + x
    return x + 0.5 * torch.tanh(t).mean()


def call_child(child, x):
    if isinstance(child, nn.Linear):
        return child(x[:, None].expand(x.shape[0], child.in_features)).mean(-1) + x
    if isinstance(child, nn.Embedding):
        return child(torch.arange(x.shape[0], device=x.device) % child.num_embeddings).mean(-1) + x
    if isinstance(child, nn.LayerNorm):
        n = child.normalized_shape[0]
        return child(x[:, None] + torch.arange(n, dtype=x.dtype, device=x.device)).mean(-1) + x
    if type(child) in (nn.ModuleList, nn.ModuleDict, nn.Sequential):
        for c in child._modules.values():
            x = call_child(c, x)
        return x
    return child(x)


def generic_forward(self, x):
    for name in self.case_params:
        x = x + 0.5 * torch.tanh(getattr(self, name)).mean()
    for name in self.case_buffers:
        x = x + getattr(self, name).mean()
    for child in self._modules.values():
        x = call_child(child, x)
    return x
'''
