"""Build an nn.Module from a CaseSpec, deterministically from its seed."""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from conformance.case.graph import class_id
from conformance.case.model_case import ModelCase
from conformance.case.spec import CaseSpec, MethodCall, ModuleSpec
from conformance.case.target import Target, apply_freeze, cached_target, make_model
from conformance.case.tree import join, walk

_TORCH_BASES = {
    "Module": nn.Module,
    "Sequential": nn.Sequential,
    "ModuleList": nn.ModuleList,
    "ModuleDict": nn.ModuleDict,
}
BATCH = 2


@dataclass
class Built:
    model: nn.Module
    classes: dict[str, type]  # class name -> class (drawn and torch's)
    modules: dict[str, nn.Module]  # spec path -> module (the spec's own tree)
    device: torch.device = torch.device("cpu")  # where example inputs are made (adapters place the model)

    def module_paths(self) -> dict[int, str]:
        """id(module) -> its spec path (a shared module keeps its source's path)."""
        return {id(m): p for p, m in self.modules.items()}

    def example_input(self) -> torch.Tensor:
        return torch.linspace(-1.0, 1.0, BATCH, device=self.device)


def _generic_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Parameters are read by attribute, not from _parameters: FSDP1 with
    # use_orig_params=False swaps them for plain tensor views during forward.
    for name in self._case_param_names:
        x = x + 0.5 * torch.tanh(getattr(self, name)).mean()
    for name in self._case_buffer_names:
        x = x + getattr(self, name).mean()
    return _run_children(self, x)


def _run_children(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Each child of ``module`` on the running activation in turn; a pair
    (``_case_pairs``: first -> second, a tensor-parallel MLP) runs as one:
    second(tanh(first(x))), its hidden activation passed on whole."""
    skip = module.__dict__.get("_case_skip", ())  # a microbatch that passes over some children (ACCUM)
    pairs = module.__dict__.get("_case_pairs", {})
    seconds = set(pairs.values())
    for name, child in module._modules.items():
        if name in skip or name in seconds:
            continue
        if name in pairs:
            second = module._modules[pairs[name]]
            inner = getattr(child, "module", child)
            h = torch.tanh(child(x[:, None].expand(x.shape[0], inner.in_features)))
            x = second(h).mean(-1) + x
        else:
            x = call_child(child, x)
    return x


def is_torch_sequential(m: nn.Module) -> bool:
    """torch's own Sequential, or the class fully_shard gives one
    (FSDPSequential: FSDPModule and nn.Sequential its bases); not a
    subclass with a forward of its own."""
    return type(m) is nn.Sequential or (isinstance(m, nn.Sequential) and nn.Sequential in type(m).__bases__)


def call_child(child: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Run ``child`` on the running activation ``x`` (shape (BATCH,))."""
    inner = getattr(child, "module", child)  # an FSDP1 wrapper's wrapped module
    if isinstance(inner, nn.Linear):
        return child(x[:, None].expand(x.shape[0], inner.in_features)).mean(-1) + x
    if isinstance(inner, nn.Embedding):
        idx = torch.arange(x.shape[0], device=x.device) % inner.num_embeddings
        return child(idx).mean(-1) + x
    if isinstance(inner, nn.LayerNorm):
        n = inner.normalized_shape[0]
        return child(x[:, None] + torch.arange(n, dtype=x.dtype, device=x.device)).mean(-1) + x
    if is_torch_sequential(inner) and (inner is not child or type(inner) is not nn.Sequential):
        # torch's Sequential as an FSDP1 unit (its wrapper) or given to
        # fully_shard (FSDP2 gives it a class of its own): a user's model
        # calls it, so FSDP's forward hooks unshard it, its children running
        # as the case's (thorough seed 539271: load_state_dict(assign=True)
        # unties 0.1.weight from 0.0.weight, and a size-based policy then
        # wraps the Sequential)
        inner.__dict__.setdefault("forward", functools.partial(_run_children, inner))  # once per module
        return child(x)
    if type(inner) in (nn.ModuleList, nn.ModuleDict, nn.Sequential):
        # torch's own containers (no usable forward): run their children
        return _run_children(inner, x)
    return child(x)


# ---- user forward methods ---------------------------------------------------

# The arguments a keyword call passes: m(x, SHIFT, scale=SCALE).
SHIFT, SCALE = 0.25, 1.5
# Called from inside every method: probe(module, method name, attribute path,
# tensor, step) with step -1 for each of module.named_parameters() on entry,
# else the index of the "param" step that reads the tensor. Set by an adapter
# that records what a method sees; None: no recording.
_probe: Callable | None = None


def set_probe(fn: Callable | None) -> Callable | None:
    """Install ``fn`` as the method probe; returns the previous one."""
    global _probe
    old, _probe = _probe, fn
    return old


def is_sharded(t: torch.Tensor) -> bool:
    """A DTensor (FSDP2's sharded parameter), told by its public attribute."""
    return hasattr(t, "device_mesh")


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of a DTensor; a plain tensor as it is."""
    return t.to_local() if is_sharded(t) else t


def read_attr(obj, path: str):
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)  # FSDP1 wrappers forward attribute access
    return obj


def _use_param(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 2:  # a head reusing a weight: F.linear, as HF generate()'s tied head
        return F.linear(x[:, None].expand(x.shape[0], t.shape[1]), t).mean(-1) + x
    return x + 0.5 * torch.tanh(t).mean()


def _run_method(self: nn.Module, name: str, x: torch.Tensor, shift: float, scale: float) -> torch.Tensor:
    steps = self.__dict__.get("_case_methods", {}).get(name, ())
    probe = _probe
    if probe is not None:
        for rel, p in self.named_parameters():
            probe(self, name, rel, p, -1)
    x = x + shift
    for i, st in enumerate(steps):
        if st.op == "param":
            t = read_attr(self, st.target)
            if probe is not None:
                probe(self, name, st.target, t, i)
            if not is_sharded(t):  # a sharded one: nothing to compute with; the probe says so
                x = _use_param(x, t)
        elif st.op == "child":
            x = call_child(read_attr(self, st.target), x)
        elif st.op == "forward":
            x = self.forward(x)
        else:
            x = self(x)
    return x * scale


def _make_method(name: str):
    def method(self, x, shift=0.0, *, scale=1.0):
        return _run_method(self, name, x, shift, scale)

    method.__name__ = method.__qualname__ = name
    return method


def method_callable(model: nn.Module, spec: CaseSpec, index: int):
    """The bound method spec.methods[index] of ``model`` (-1: the model itself)."""
    if index == -1:
        return model
    m = spec.methods[index]
    return getattr(read_attr(model, m.module), m.name)


def call_args(x: torch.Tensor, call: MethodCall) -> tuple[tuple, dict]:
    return ((x, SHIFT), {"scale": SCALE}) if call.keyword and call.method != -1 else ((x,), {})


def make_classes(spec: CaseSpec) -> dict[str, type]:
    classes: dict[str, type] = dict(_TORCH_BASES)
    classes.update(Linear=nn.Linear, Embedding=nn.Embedding, LayerNorm=nn.LayerNorm)
    pending = list(spec.classes)
    while pending:  # bases first (validate() excludes cycles)
        c = next(c for c in pending if c.base in classes)
        pending.remove(c)
        classes[c.name] = type(c.name, (classes[c.base],), {"forward": _generic_forward, "__module__": "case"})
    return classes


def _make_module(m: ModuleSpec, classes: dict[str, type]) -> nn.Module:
    if m.cls == "Linear":
        w = m.params[0].shape
        return nn.Linear(w[1], w[0], bias=len(m.params) == 2)
    if m.cls == "Embedding":
        return nn.Embedding(*m.params[0].shape)
    if m.cls == "LayerNorm":
        return nn.LayerNorm(m.params[0].shape[0])
    mod = classes[m.cls]()
    mod._case_param_names = [p.name for p in m.params]
    mod._case_buffer_names = [b.name for b in m.buffers]
    for p in m.params:
        mod.register_parameter(p.name, nn.Parameter(torch.empty(p.shape)))
    for b in m.buffers:
        mod.register_buffer(b.name, torch.empty(b.shape))
    return mod


def build(spec: CaseSpec) -> Built:
    """The case's model: same spec and seed, same module and values. A
    ModelCase builds its target's model (conformance.case.build.build_target).
    Inside a ``released()`` block, its modules are released when the block ends."""
    built = build_target(spec) if isinstance(spec, ModelCase) else _build_spec(spec)
    if _scopes:
        _scopes[-1].extend(weakref.ref(m) for m in built.model.modules())
    return built


# The modules build() made in each open released() block (innermost last).
_scopes: list[list[weakref.ref]] = []


@contextlib.contextmanager
def released() -> Iterator[None]:
    """Release every module build() makes inside the block when it ends
    (the engine runs each scenario in one): its parameters, buffers,
    submodules and tensor attributes are dropped, so that the example's
    model is freed even where FSDP tied it into a cycle that Python's
    collector cannot see. FSDP1 with use_orig_params=False does: a wrapped
    module holds views of its FlatParameter, whose autograd nodes hold the
    FlatParameter from C++, whose ParamInfo entries hold the module
    (pytorch/pytorch#183211). Unreleased, every such example's model stayed
    in memory for the rest of the process, and every full collection of the
    garbage collector walked them all again. A module still in use after the
    block is emptied too: a block's models belong to it."""
    refs: list[weakref.ref] = []
    _scopes.append(refs)
    try:
        yield
    finally:
        _scopes.remove(refs)
        for ref in refs:
            m = ref()
            if m is not None:
                _empty(m)


def _empty(m: nn.Module) -> None:
    state = vars(m)
    for k in [k for k, v in state.items() if isinstance(v, torch.Tensor)]:
        del state[k]
    m._parameters.clear()
    m._buffers.clear()
    m._modules.clear()


def _build_spec(spec: CaseSpec) -> Built:
    classes = make_classes(spec)
    modules: dict[str, nn.Module] = {}
    for path, m in walk(spec.tree):
        mod = _make_module(m, classes)
        modules[path] = mod
        if path:
            parent_path = path.rpartition(".")[0]
            modules[parent_path].add_module(m.name, mod)
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for path, m in walk(spec.tree):
            mod = modules[path]
            for p in m.params:
                t = getattr(mod, p.name)
                t.copy_(torch.randn(p.shape, generator=gen) * 0.5)
                t.requires_grad_(p.requires_grad)
            for b in m.buffers:
                getattr(mod, b.name).copy_(torch.randn(b.shape, generator=gen))
    params = {join(path, p.name): getattr(modules[path], p.name) for path, m in walk(spec.tree) for p in m.params}
    for s in spec.shared:
        modules[s.parent].add_module(s.name, modules[s.source])
    for t in spec.ties:
        mod = modules[t.module]
        setattr(mod, t.name, params[t.source])
        names = getattr(mod, "_case_param_names", None)
        if names is not None and t.name not in names:
            names.append(t.name)
    for first, second in spec.tp.pairs if spec.tp is not None else ():
        parent = modules[first.rpartition(".")[0]]
        parent.__dict__.setdefault("_case_pairs", {})[first.rpartition(".")[2]] = second.rpartition(".")[2]
    for m in spec.methods:
        # On the class (as a user writes it), the body per instance: other
        # instances of the class run an empty body.
        cls = type(modules[m.module])
        if m.name not in cls.__dict__:
            setattr(cls, m.name, _make_method(m.name))
        modules[m.module].__dict__.setdefault("_case_methods", {})[m.name] = m.steps
    return Built(model=modules[""], classes=classes, modules=modules)


# ---- a real model (a Target) ----------------------------------------------


@dataclass
class TargetBuilt(Built):
    """Built for a target: example inputs are the target's keyword arguments."""

    target: Target | None = None
    seed: int = 0

    def example_input(self):
        return {k: v.to(self.device) if hasattr(v, "to") and hasattr(v, "device") else v
                for k, v in dict(self.target.inputs(self.seed)).items()}


def build_target(case):
    """A ModelCase's model, as conformance.case.build.Built: the target's factory
    at the case's seed with its freeze mask; modules by canonical path,
    classes by the names a policy may use for them (classes_by_name)."""
    model = make_model(case.target, case.seed)
    apply_freeze(model, case.frozen)
    modules: dict[str, Any] = {}
    for path, m in model.named_modules():
        modules.setdefault(path, m)
    return TargetBuilt(model=model, classes=classes_by_name(model), modules=modules, target=cached_target(case.target), seed=case.seed)


def classes_by_name(model) -> dict[str, type]:
    """Every nn.Module class in the model's modules' MROs under the names
    ModelGraph.resolve_class accepts for it: its id ``module.QualName``,
    and its bare name where no other class of the model has that name (two
    classes of one name, PEFT's lora.Linear and torch's nn.Linear, are
    reachable only by their ids)."""
    by_id: dict[str, type] = {}
    for m in model.modules():
        for k in type(m).__mro__:
            if isinstance(k, type) and issubclass(k, nn.Module):
                by_id.setdefault(class_id(k), k)
    out = dict(by_id)
    short: dict[str, list[type]] = {}
    for k in by_id.values():
        short.setdefault(k.__name__, []).append(k)
    for name, ks in short.items():
        if len(ks) == 1 and name not in out:
            out[name] = ks[0]
    return out
