"""FSDP2 adapter: fully_shard a built case bottom-up, register its forward
methods, make its calls, and observe what FSDP2 did. The only module that
reads FSDP2's private state; version differences are hidden here."""

from __future__ import annotations

import contextlib
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.adapters.fsdp1 import Aliases
from conformance.case.build import Built, build, call_args, is_sharded, method_callable, read_attr, set_probe
from conformance.adapters.support import fsdp2_mesh, placed
from conformance.observations import (
    CallObservation,
    FSDP2Observation,
    GradObservation,
    GroupObservation,
    ProbeObservation,
    RegistrationObservation,
)
from conformance.oracle.fsdp2 import shard_order
from conformance.case.target import graph_of
from conformance.case.spec import CaseSpec, effective_calls
from conformance.case.tree import join

MISSING_NAME = "no_such_forward_method"
RTOL, ATOL = 1e-4, 1e-5


# ---- torch version differences -----------------------------------------------


def fsdp2_api():
    """(fully_shard, FSDPModule, register_fsdp_forward_method): public in
    torch.distributed.fsdp from 2.6, torch.distributed._composable.fsdp before."""
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
    except ImportError:  # torch 2.4, 2.5
        from torch.distributed._composable.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
    return fully_shard, FSDPModule, register_fsdp_forward_method


def takes_ignored_params() -> bool:
    """Whether this torch's fully_shard takes ``ignored_params`` (2.7 on)."""
    import inspect

    try:
        return "ignored_params" in inspect.signature(fsdp2_api()[0]).parameters
    except (ImportError, TypeError, ValueError):
        return False


def has_reduction_setters() -> bool:
    """Whether this torch's FSDPModule has set_force_sum_reduction_for_comms
    and set_gradient_divide_factor (2.8 on)."""
    try:
        FSDPModule = fsdp2_api()[1]
    except ImportError:
        return False
    return all(hasattr(FSDPModule, n) for n in ("set_force_sum_reduction_for_comms", "set_gradient_divide_factor"))


def set_reduction(model, force_sum: bool, divide_factor: float | None) -> None:
    """The plan's gradient reduction settings on every FSDP module of ``model``."""
    FSDPModule = fsdp2_api()[1]
    for m in model.modules():
        if isinstance(m, FSDPModule):
            if force_sum:
                m.set_force_sum_reduction_for_comms(True)
            if divide_factor is not None:
                m.set_gradient_divide_factor(divide_factor)


def count_collectives():
    """A dispatch mode that counts the collectives issued under it, by op
    name. (torch's CommDebugMode also tracks modules, and its module tracker
    breaks on a method that calls self(...) outside any module forward.)"""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCollectives(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if name.startswith(("c10d", "_c10d_functional")):
                self.counts[name] += 1
            return func(*args, **(kwargs or {}))

        def get_comm_counts(self):
            return self.counts

    return CountCollectives()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The unsharded value of a DTensor (a collective: every rank calls it), or ``t``."""
    return t.full_tensor() if is_sharded(t) else t


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.10: several per state
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [one] if one is not None else []
    return list(groups)


def observed_groups(model: nn.Module, aliases: Aliases) -> list[GroupObservation]:
    """One entry per FSDP state: the modules it was given and the canonical
    FQNs of its FSDPParams (by the module slot each parameter sits in)."""
    fully_shard, _, _ = fsdp2_api()
    seen: dict[int, tuple[list[str], list[str]]] = {}
    for m in model.modules():
        state = fully_shard.state(m)
        if state is None:
            continue
        mods, managed = seen.setdefault(id(state), ([], []))
        mods.append(aliases.canon_of_module.get(id(m), "?"))
        if len(mods) == 1:
            for grp in _param_groups(state):
                for fp in grp.fsdp_params:
                    info = fp._module_info
                    managed.append(aliases.by_slot.get((id(info.module), info.param_name), info.param_name))
    return [GroupObservation(tuple(mods), tuple(managed)) for mods, managed in seen.values()]


def _allgathers(counts: dict) -> int:
    return sum(n for op, n in counts.items() if "all_gather" in str(op) or "allgather" in str(op))


def _err(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"


# ---- sharding and registration ----------------------------------------------------


def shard(spec: CaseSpec, built: Built, extra=None) -> None:
    """fully_shard bottom-up: each group (the multi-module form for several
    modules) after every group below it, the root last. ``extra(modules)``:
    more fully_shard kwargs for the group of those spec paths (mp_policy)."""
    fully_shard, _, _ = fsdp2_api()
    ignored = {built.model.get_parameter(f) for f in spec.plan.ignored_params}
    mesh = fsdp2_mesh()
    for grp in shard_order(spec.plan, graph_of(spec)):
        mods = [built.modules[p] for p in grp.modules]
        kwargs = {"mesh": mesh}
        if grp.reshard_after_forward is not None:
            kwargs["reshard_after_forward"] = grp.reshard_after_forward
        if ignored:
            kwargs["ignored_params"] = ignored
        if extra is not None:
            kwargs.update(extra(grp.modules))
        fully_shard(mods if len(mods) > 1 else mods[0], **kwargs)


def _method_func(cls: type, name: str):
    for k in cls.__mro__:
        if name in k.__dict__:
            return k.__dict__[name]
    return None


def register(spec: CaseSpec, built: Built, ref: Built) -> list[RegistrationObservation]:
    _, FSDPModule, register_fsdp_forward_method = fsdp2_api()
    # Every instance a registration must leave alone: the other modules of
    # the same class, and the reference model's.
    before = {}
    for i, m in enumerate(spec.methods):
        cls = built.classes[_spec_cls(spec, m.module)]
        others = [mod for path, mod in built.modules.items() if isinstance(mod, cls) and path != m.module]
        others.append(ref.modules[m.module])
        before[i] = [(o, _method_func(type(o), m.name), m.name in o.__dict__) for o in others]
    out = []
    for i, m in enumerate(spec.methods):
        mod = built.modules[m.module]
        error = None
        if m.register:
            try:
                register_fsdp_forward_method(mod, m.name)
            except Exception as e:
                error = _err(e)
        out.append(RegistrationObservation(i, isinstance(mod, FSDPModule), m.name in mod.__dict__, True, error))
    for i, m in enumerate(spec.methods):
        same = all(
            _method_func(type(o), m.name) is func and (m.name in o.__dict__) == had
            for o, func, had in before[i]
            # an instance registered under the same name itself is changed on
            # purpose; one whose method of that name is not registered is not
            if o is not built.modules[m.module] and not any(o is built.modules[x.module] and x.name == m.name and x.register for x in spec.methods)
        )
        out[i] = RegistrationObservation(out[i].method, out[i].fsdp_module, out[i].patched, same, out[i].error)
    return out


def _spec_cls(spec: CaseSpec, path: str) -> str:
    from conformance.case.spec import module_at

    return module_at(spec.tree, path).cls


def missing_names(spec: CaseSpec, built: Built) -> list[tuple[str, bool, str | None]]:
    """register_fsdp_forward_method with a name the module lacks, on the root
    and on every module with a method."""
    _, FSDPModule, register_fsdp_forward_method = fsdp2_api()
    out = []
    for path in dict.fromkeys([""] + [m.module for m in spec.methods]):
        mod = built.modules[path]
        try:
            register_fsdp_forward_method(mod, MISSING_NAME)
            err = None
        except Exception as e:
            err = type(e).__name__
        out.append((path, isinstance(mod, FSDPModule), err))
    return out


# ---- the calls ----------------------------------------------------------------------


class _Probe:
    def __init__(self, aliases: Aliases, ref: dict[str, torch.Tensor]):
        self.aliases = aliases
        self.ref = ref
        self.call = 0
        self.records: list[ProbeObservation] = []

    def __call__(self, module: nn.Module, name: str, rel: str, t: torch.Tensor, step: int) -> None:
        path = self.aliases.canon_of_module.get(id(module))
        if path is None:
            return  # the reference model's modules
        fqn = self.aliases.param_canon.get(join(path, rel), join(path, rel))
        want = self.ref.get(fqn)
        if is_sharded(t):
            state, equal = "sharded", None
        elif want is not None and tuple(t.shape) == tuple(want.shape):
            state, equal = "full", bool(torch.equal(t.detach(), want))
        else:
            state, equal = "other", None
        self.records.append(ProbeObservation(self.call, step, fqn, state, equal))


def _group_states(model: nn.Module, groups: list[GroupObservation]) -> tuple[str, ...]:
    out = []
    for grp in groups:
        flags = {is_sharded(read_attr(model, f)) for f in grp.managed}
        out.append("sharded" if flags == {True} else "full" if flags == {False} else "mixed" if flags else "empty")
    return tuple(out)


def observe(spec: CaseSpec) -> FSDP2Observation:
    """Shard the case with FSDP2 on the current default process group,
    register and call its methods, run backward; compare with an unsharded
    reference model built from the same spec on this rank."""
    base = dict(
        api="fsdp2",
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        backend=str(dist.get_backend()),
        torch_version=torch.__version__,
    )
    built, ref = placed(build(spec)), placed(build(spec))
    aliases = Aliases(built.model)
    initial = {f: p.detach().clone() for f, p in ref.model.named_parameters(remove_duplicate=False)}
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            shard(spec, built)
        except Exception as e:  # a rejection is an observation
            return FSDP2Observation(**base, wrap_error=_err(e), seconds=time.perf_counter() - t0)
        groups = observed_groups(built.model, aliases)
        regs = register(spec, built, ref)
        missing = missing_names(spec, built)
    shown = tuple(dict.fromkeys(str(w.message).splitlines()[0] for w in caught if issubclass(w.category, UserWarning)))
    probe = _Probe(aliases, initial)
    calls, outs, ref_outs = [], [], []
    old = set_probe(probe)
    index = 0
    try:
        for call in effective_calls(spec):
            for _ in range(call.times):
                probe.call = index
                x = built.example_input()
                args, kwargs = call_args(x, call)
                start = len(probe.records)
                try:
                    with count_collectives() as comm:
                        out = method_callable(built.model, spec, call.method)(*args, **kwargs)
                except Exception as e:
                    calls.append(CallObservation(index, call.method, 0, None, None, _err(e), _group_states(built.model, groups)))
                    raise _Stop from None
                with _no_probe():
                    want = method_callable(ref.model, spec, call.method)(*args, **kwargs)
                diff = float((out.detach() - want.detach()).abs().max()) if out.shape == want.shape else float("inf")
                close = out.shape == want.shape and bool(torch.allclose(out.detach(), want.detach(), rtol=RTOL, atol=ATOL))
                calls.append(
                    CallObservation(index, call.method, _allgathers(comm.get_comm_counts()), close, diff, None, _group_states(built.model, groups))
                )
                # outputs that computed with a sharded parameter (the method
                # skipped it) stay out of the loss on both sides
                if not any(p.state != "full" and p.step >= 0 for p in probe.records[start:]):
                    outs.append(out)
                    ref_outs.append(want)
                index += 1
    except _Stop:
        pass
    finally:
        set_probe(old)
    seconds = time.perf_counter() - t0
    obs = dict(base, groups=tuple(groups), registrations=tuple(regs), missing=tuple(missing), calls=tuple(calls),
               probes=tuple(probe.records), warnings=shown, seconds=seconds)
    if any(c.error for c in calls):
        return FSDP2Observation(**obs, ties_intact=_ties(built.model, aliases))
    grads, ran, berr = (), False, None
    if outs and any(o.requires_grad for o in outs):
        try:
            sum((o**2).sum() for o in outs).backward()
            sum((o**2).sum() for o in ref_outs).backward()
            ran = True
        except Exception as e:
            berr = _err(e)
    if berr is None:
        grads = tuple(_grads(built.model, ref.model, initial))
    return FSDP2Observation(**obs, backward_ran=ran, backward_error=berr, grads=grads, ties_intact=_ties(built.model, aliases))


class _Stop(Exception):
    pass


@contextlib.contextmanager
def _no_probe():
    old = set_probe(None)
    try:
        yield
    finally:
        set_probe(old)


def _grads(model: nn.Module, ref: nn.Module, initial: dict[str, torch.Tensor]) -> list[GradObservation]:
    refs = dict(ref.named_parameters(remove_duplicate=False))
    out = []
    for fqn, p in model.named_parameters():
        r = refs[fqn]
        value = full_tensor(p.detach())
        unchanged = bool(torch.equal(value, initial[fqn]))
        g = None if p.grad is None else full_tensor(p.grad)
        if g is None or r.grad is None:
            out.append(GradObservation(fqn, g is None, r.grad is None, None, None, unchanged))
            continue
        close = bool(torch.allclose(g, r.grad, rtol=RTOL, atol=ATOL))
        out.append(GradObservation(fqn, False, False, close, float((g - r.grad).abs().max()), unchanged))
    return out


def _ties(model: nn.Module, aliases: Aliases) -> tuple[tuple[str, bool], ...]:
    return tuple(
        (canon, len({id(read_attr(model, n)) for n in names}) == 1) for canon, names in sorted(aliases.tied.items())
    )
