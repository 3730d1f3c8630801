"""What every API's repro script shares: torch-only code that builds a case's
module tree (shared modules and ties included) and its classes."""

from __future__ import annotations

import torch

from conformance.case.spec import CaseSpec, CustomWrap, LambdaWrap, ModuleWrap, SizeBasedWrap, TransformerWrap
from conformance.case.tree import walk

# The harness every generated script shares (the convention: conformance/run/repros.py):
# the backend and device, chosen by an environment variable so that the same
# script runs on CPU (gloo, the default) and on GPUs; the process group for
# `python` or torchrun; and the verdict line rank 0 prints last.
HARNESS = '''
BACKEND = os.environ.get("FSDP_REPRO_BACKEND", "gloo")  # nccl: every rank on its GPU (cuda:LOCAL_RANK)
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if BACKEND == "nccl" else torch.device("cpu")


def init():
    """torchrun sets RANK; a plain `python` run is one rank on a free port."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(BACKEND)


def finish(deviation, as_specified):
    """Rank 0 prints the verdict last: DEVIATION if a rank saw one (None: it saw none)."""
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, deviation)
    dist.barrier()
    if dist.get_rank() == 0:
        found = next((d for d in seen if d), None)
        print(f"DEVIATION: {found}" if found else f"AS SPECIFIED: {as_specified}", flush=True)
    print(end="", flush=True)
    os._exit(0)  # every rank leaves here, the group not torn down (gloo's teardown can abort a rank now and then)
'''

# The modes a generated script offers unless its generator is told otherwise:
# (command, shown, why not), the script named repro.py.
DEFAULT_MODES = (("python repro.py", True, ""), ("torchrun --nproc-per-node 2 repro.py", True, ""))


def header(title: str, violations: list | None = None, expected: str = "", modes=DEFAULT_MODES, finding: str = "",
           name: str = "repro.py") -> str:
    """The script's docstring: what it reproduces, what the spec expects, and
    its modes (``Run:`` / ``Not shown by:`` lines, the script named ``name``)."""
    lines = [f"fsdp-conformance reproduction{': ' + title if title else ''}", "", f"Found with torch {torch.__version__}."]
    lines += [f"Seen: {v}" for v in violations or ()]
    if expected:
        lines += ["", expected]
    lines.append("")
    if finding:
        lines.append(f"Finding: {finding}")
    for cmd, shown, why in modes:
        cmd = cmd.replace("repro.py", name)
        lines.append(f"Run: {cmd}" if shown else f"Not shown by: {cmd}: {why}")
    text = "\n".join(lines).replace('"""', "'''").replace("\\", "/")
    return f'"""{text}\n"""'


def from_import(module: str, names) -> list[str]:
    """``from module import ...`` lines as ruff's isort writes them: the
    plain names (constants, classes, functions) on one line, wrapped one per
    line past 140 characters, each ``X as Y`` on its own line, the lines in
    the order of their first names."""
    def key(n):
        return 0 if n.isupper() else 1 if n[0].isupper() else 2, n

    plain = sorted({n for n in names if " as " not in n}, key=key)
    lines = [(key(n), f"from {module} import {n}") for n in {n for n in names if " as " in n}]
    if plain:
        line = f"from {module} import {', '.join(plain)}"
        lines.append((key(plain[0]), line if len(line) <= 140 else f"from {module} import (\n" + "".join(f"    {n},\n" for n in plain) + ")"))
    return [line for _, line in sorted(lines)]


def assemble(doc: str, imports: str, parts: list[str]) -> str:
    """A script as ruff's isort and pyflakes want it: the docstring, the
    imports, then the parts two blank lines apart."""
    body = "\n\n\n".join(p.strip("\n") for p in parts if p.strip())
    return f"{doc}\n\n{imports.strip()}\n\n{body}\n"


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


def suite_script(spec: CaseSpec, violations: list | None = None, title: str = "", *, modes=None, finding: str = "",
                 name: str = "repro.py") -> str:
    """A script that replays the case with fsdp-conformance installed (for an
    API that has no torch-only generator yet): checks ``title``'s invariant,
    or every invariant of the case's API, on the fake tier (then on two gloo
    ranks where the fake tier compared no values) or $BACKEND; its verdict
    is the check's exit status, the known failures unread (a recorded
    finding's deviation is still a DEVIATION)."""
    doc = header(f"{title} ({spec.plan.api})" if title else f"({spec.plan.api})", violations,
                 f"No torch-only generator for API {spec.plan.api!r} yet: this script replays the case through fsdp-conformance "
                 "(BACKEND=gloo WORLD_SIZE=2 python repro.py for a rank pool).", modes or (("python repro.py", True, ""),), finding, name)
    inv = title if title and title.upper() == title and " " not in title else ""
    body = f'''
import contextlib
import io
import os
import sys
import tempfile

from conformance.areas.common.catalog import VALUES_UNCHECKED
from conformance.cli import main

CASE = {spec.to_json()!r}
INVARIANT = {inv!r}


def check(path, backend, world):
    """`fsdp-conformance check`, its verdicts echoed; --no-known: a deviation
    the suite has recorded as a finding still is one."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["check", path, "--no-known", "--backend", backend, "--world-size", world] + (["--invariant", INVARIANT] if INVARIANT else []))
    sys.stdout.write(out.getvalue())
    return rc, out.getvalue()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:  # the case file goes with it
        path = os.path.join(tmp, "case.json")
        with open(path, "w") as f:
            f.write(CASE)
        backend = os.environ.get("BACKEND")
        rc, out = check(path, backend or "fake", os.environ.get("WORLD_SIZE", "4"))
        if backend is None and not rc and VALUES_UNCHECKED.reason in out:  # the fake tier compares no values: two gloo ranks do
            rc, out = check(path, "gloo", os.environ.get("WORLD_SIZE", "2"))
    print(f"DEVIATION: fsdp-conformance check reports a violation (exit status {{rc}})" if rc else
          "AS SPECIFIED: fsdp-conformance check reports no violation", flush=True)
'''
    return doc + "\n" + body


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


def policy_imports(spec: CaseSpec) -> tuple[list[str], list[str]]:
    """What policy_code's statement needs: import lines, and the names it
    takes from torch.distributed.fsdp (ShardingStrategy for a CustomPolicy's kwargs)."""
    pol = spec.plan.policy
    if pol is None:
        return [], []
    name = {ModuleWrap: "ModuleWrapPolicy", TransformerWrap: "transformer_auto_wrap_policy", SizeBasedWrap: "size_based_auto_wrap_policy",
            LambdaWrap: "lambda_auto_wrap_policy", CustomWrap: "CustomPolicy"}[type(pol)]
    out = ["import functools"] if isinstance(pol, (TransformerWrap, SizeBasedWrap, LambdaWrap)) else []
    out.append(f"from torch.distributed.fsdp.wrap import {name}")
    strategy = isinstance(pol, CustomWrap) and any(k == "sharding_strategy" for _, kw in pol.kwargs for k, _ in kw)
    return out, ["ShardingStrategy"] if strategy else []


# The case's forward and helpers, as conformance/build.py defines them.
FSDP2_RUNTIME = '''
def read_attr(obj, path):
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj


def is_sharded(t):
    return hasattr(t, "device_mesh")  # a DTensor: FSDP2's sharded parameter


def use_param(x, t):
    if t.dim() == 2:  # a head reusing a weight through F.linear (HF generate()'s tied head)
        return F.linear(x[:, None].expand(x.shape[0], t.shape[1]), t).mean(-1) + x
    return x + 0.5 * torch.tanh(t).mean()


def call_child(child, x):
    inner = getattr(child, "module", child)  # an FSDP1 wrapper's module
    if isinstance(inner, nn.Linear):
        return child(x[:, None].expand(x.shape[0], inner.in_features)).mean(-1) + x
    if isinstance(inner, nn.Embedding):
        return child(torch.arange(x.shape[0], device=x.device) % inner.num_embeddings).mean(-1) + x
    if isinstance(inner, nn.LayerNorm):
        n = inner.normalized_shape[0]
        return child(x[:, None] + torch.arange(n, dtype=x.dtype, device=x.device)).mean(-1) + x
    torch_seq = type(inner) is nn.Sequential or (isinstance(inner, nn.Sequential) and nn.Sequential in type(inner).__bases__)
    if torch_seq and (inner is not child or type(inner) is not nn.Sequential):  # an FSDP1 unit or fully_shard's: called, so FSDP unshards it
        inner.forward = lambda y: run_children(inner, y)
        return child(x)
    if type(inner) in (nn.ModuleList, nn.ModuleDict, nn.Sequential):
        return run_children(inner, x)
    return child(x)


def run_children(module, x):
    skip = module.__dict__.get("case_skip", ())  # the children a schedule's microbatch skips
    for name, c in module._modules.items():
        if name not in skip:
            x = call_child(c, x)
    return x


def generic_forward(self, x):
    for name in self.case_params:
        x = x + 0.5 * torch.tanh(getattr(self, name)).mean()
    for name in self.case_buffers:
        x = x + getattr(self, name).mean()
    skip = self.__dict__.get("case_skip", ())
    for name, child in self._modules.items():
        if name not in skip:
            x = call_child(child, x)
    return x
'''
