"""FSDP2 adapter: fully_shard a built case bottom-up, register its forward
methods, make its calls, and observe what FSDP2 did. The only module that
reads FSDP2's private state; version differences are hidden here."""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.areas.common.fsdp1_adapter import Aliases
from conformance.areas.common.fsdp2_adapter import count_collectives, error_line, fsdp2_api, full_tensor, full_tensors, shard, watch_method
from conformance.areas.common.observation import CallObservation, GradObservation
from conformance.areas.common.support import on_rank_device, placed, unchanged
from conformance.areas.common.timing import Stopwatch
from conformance.areas.common.training import FORWARD_ATOL, FORWARD_RTOL
from conformance.areas.fully_shard.observation import FSDP2Observation, GroupObservation, ProbeObservation, RegistrationObservation
from conformance.case.build import Built, build, call_args, is_sharded, method_callable, read_attr, set_probe
from conformance.case.model_case import ModelCase
from conformance.case.spec import CaseSpec, effective_calls, module_at
from conformance.case.target import method_kwargs, target_loss
from conformance.case.tree import join

MISSING_NAME = "no_such_forward_method"


# ---- torch version differences -----------------------------------------------


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


# ---- sharding and registration ----------------------------------------------------


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
                error = error_line(e)
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
        self.watch = None  # the MethodWatch of the call under way


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
        if state != "full" and step >= 0 and self.watch is not None and self.watch.nested:
            # a drawn method skips a sharded parameter rather than compute with it:
            # the probe is where its sharded read is seen
            self.watch.sharded_reads += 1
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
    # FSDP's work: fully_shard, registration, the calls (with the collective
    # counting and read watching they run under), backward, the full values'
    # read; not the suite's own reading of groups, probes and outputs
    fsdp = Stopwatch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with fsdp.timing():
                shard(spec, built)
        except Exception as e:  # a rejection is an observation
            return FSDP2Observation(**base, wrap_error=error_line(e), seconds=fsdp.seconds)
        groups = observed_groups(built.model, aliases)
        with fsdp.timing():
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
                owner = read_attr(built.model, spec.methods[call.method].module) if call.method >= 0 else None
                try:
                    with fsdp.timing(), count_collectives() as comm, watch_method(owner) as watch:
                        probe.watch = watch
                        out = method_callable(built.model, spec, call.method)(*args, **kwargs)
                except Exception as e:
                    calls.append(CallObservation(index, call.method, 0, None, None, error_line(e), _group_states(built.model, groups),
                                                 watch.nested, watch.sharded_reads))
                    raise _Stop from None
                with _no_probe():
                    want = method_callable(ref.model, spec, call.method)(*args, **kwargs)
                diff = float((out.detach() - want.detach()).abs().max()) if out.shape == want.shape else float("inf")
                close = out.shape == want.shape and bool(torch.allclose(out.detach(), want.detach(), rtol=FORWARD_RTOL, atol=FORWARD_ATOL))
                calls.append(
                    CallObservation(index, call.method, _allgathers(comm.get_comm_counts()), close, diff, None, _group_states(built.model, groups),
                                    watch.nested, watch.sharded_reads)
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
    obs = dict(base, groups=tuple(groups), registrations=tuple(regs), missing=tuple(missing), calls=tuple(calls),
               probes=tuple(probe.records), warnings=shown)
    if any(c.error for c in calls):
        return FSDP2Observation(**obs, ties_intact=_ties(built.model, aliases), seconds=fsdp.seconds)
    grads, ran, berr, rerr = (), False, None, None
    backward_seconds = 0.0
    if outs and any(o.requires_grad for o in outs):
        try:
            t_back = time.perf_counter()
            sum((o**2).sum() for o in outs).backward()
            backward_seconds = time.perf_counter() - t_back
            sum((o**2).sum() for o in ref_outs).backward()
            ran = True
        except Exception as e:
            berr = error_line(e)
    if berr is None:
        with fsdp.timing():
            grads, rerr = _read_grads(built.model, ref.model, initial)
    return FSDP2Observation(**obs, backward_ran=ran, backward_error=berr, grads=grads, read_error=rerr,
                            ties_intact=_ties(built.model, aliases), seconds=fsdp.seconds, backward_seconds=backward_seconds)


class _Stop(Exception):
    pass


@contextlib.contextmanager
def _no_probe():
    old = set_probe(None)
    try:
        yield
    finally:
        set_probe(old)


def _read_grads(model: nn.Module, ref: nn.Module, initial: dict[str, torch.Tensor]) -> tuple[tuple[GradObservation, ...], str | None]:
    """(the gradients compared, None), or ((), the error) where reading the
    sharded values or gradients raised: FSDP left a DTensor whose
    full_tensor() fails, an observation (read_error) rather than the
    scenario's own error. The ranks do not agree first: a rank that raised
    leaves the others in the read's all-gather, a HANG, as before."""
    try:
        return tuple(_grads(model, ref, initial)), None
    except Exception as e:
        return (), f"full values: {error_line(e)}"


def _grads(model: nn.Module, ref: nn.Module, initial: dict[str, torch.Tensor]) -> list[GradObservation]:
    refs = dict(ref.named_parameters(remove_duplicate=False))
    params = dict(model.named_parameters())
    # every value and gradient in one read (a collective: every rank runs it)
    full = full_tensors({**{(f, "value"): p for f, p in params.items()}, **{(f, "grad"): p.grad for f, p in params.items()}})
    out = []
    for fqn in params:
        r = refs[fqn]
        same = unchanged(full[fqn, "value"], initial[fqn])
        g = full[fqn, "grad"]
        if g is None or r.grad is None:
            out.append(GradObservation(fqn, g is None, r.grad is None, None, None, same))
            continue
        close = bool(torch.allclose(g, r.grad, rtol=FORWARD_RTOL, atol=FORWARD_ATOL))
        out.append(GradObservation(fqn, False, False, close, float((g - r.grad).abs().max()), same))
    return out


def _ties(model: nn.Module, aliases: Aliases) -> tuple[tuple[str, bool], ...]:
    return tuple(
        (canon, len({id(read_attr(model, n)) for n in names}) == 1) for canon, names in sorted(aliases.tied.items())
    )


def tensors(out: Any) -> list[torch.Tensor]:
    """The tensors in a model's output (a tensor, tuple/list, dict or HF ModelOutput), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):  # HF ModelOutput is an OrderedDict
        return [t for v in out.values() for t in tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in tensors(v)]
    return []


def compare(out: Any, want: Any) -> tuple[bool, float]:
    """(equal, max difference): integer tensors (tokens) exactly, floating
    ones within tolerance."""
    a, b = tensors(out), tensors(want)
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return False, float("inf")
    close, diff = True, 0.0
    for x, y in zip(a, b):
        x, y = full_tensor(x.detach()), full_tensor(y.detach())
        if x.is_floating_point():
            close &= bool(torch.allclose(x, y, rtol=FORWARD_RTOL, atol=FORWARD_ATOL))
            diff = max(diff, float((x - y).abs().max()) if x.numel() else 0.0)
        else:
            close &= bool(torch.equal(x, y))
            diff = max(diff, float((x != y).sum()))
    return close, diff


def _base(api: str) -> dict:
    return dict(api=api, rank=dist.get_rank(), world_size=dist.get_world_size(),
                backend=str(dist.get_backend()), torch_version=torch.__version__)


def observe_fsdp2(case: ModelCase) -> FSDP2Observation:
    """fully_shard the target's model as the plan says, register the drawn
    methods, call forward then each method; compare with an unsharded copy
    built from the same seed on this rank; backward through forward's loss."""
    _, FSDPModule, register_fsdp_forward_method = fsdp2_api()
    base = _base("fsdp2")
    built, ref = placed(build(case)), placed(build(case))
    aliases = Aliases(built.model)
    initial = {f: p.detach().clone() for f, p in ref.model.named_parameters(remove_duplicate=False)}
    target = built.target
    fsdp = Stopwatch()  # FSDP's work, as observe() times it: not the reference's calls or the comparisons
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with fsdp.timing():
                shard(case, built)
        except Exception as e:  # a rejection is an observation
            return FSDP2Observation(**base, wrap_error=error_line(e), seconds=fsdp.seconds)
        groups = observed_groups(built.model, aliases)
        ref_funcs = {m.name: _method_func(type(ref.model), m.name) for m in case.methods}
        regs = []
        for i, m in enumerate(case.methods):
            error = None
            if m.register:
                try:
                    with fsdp.timing():
                        register_fsdp_forward_method(built.model, m.name)
                except Exception as e:
                    error = error_line(e)
            same = _method_func(type(ref.model), m.name) is ref_funcs[m.name] and m.name not in ref.model.__dict__
            regs.append(RegistrationObservation(i, isinstance(built.model, FSDPModule), m.name in built.model.__dict__, same, error))
        missing = missing_names(case, built)
    shown = tuple(dict.fromkeys(str(w.message).splitlines()[0] for w in caught if issubclass(w.category, UserWarning)))
    by_name = {mc.name: mc for mc in target.methods}
    calls: list[CallObservation] = []
    loss = ref_loss = None
    for index, call in enumerate(case.calls):
        if call.method == -1:
            kwargs = on_rank_device(dict(target.inputs(case.seed)))
            fn, ref_fn = built.model, ref.model
        else:
            name = case.methods[call.method].name
            kwargs = on_rank_device(method_kwargs(target, by_name[name], case.seed))
            fn, ref_fn = getattr(built.model, name), getattr(ref.model, name)
        try:
            with fsdp.timing(), count_collectives() as comm, watch_method(built.model if call.method >= 0 else None) as watch:
                out = fn(**kwargs)
        except Exception as e:
            calls.append(CallObservation(index, call.method, 0, None, None, error_line(e), _group_states(built.model, groups),
                                         watch.nested, watch.sharded_reads))
            break
        want = ref_fn(**kwargs)
        close, diff = compare(out, want)
        calls.append(CallObservation(index, call.method, _allgathers(comm.get_comm_counts()), close, diff, None,
                                     _group_states(built.model, groups), watch.nested, watch.sharded_reads))
        if call.method == -1:
            try:
                loss, ref_loss = target_loss(built.target, out), target_loss(ref.target, want)
            except Exception as e:
                return FSDP2Observation(**base, groups=tuple(groups), registrations=tuple(regs), missing=tuple(missing),
                                        calls=tuple(calls), backward_error=f"loss: {error_line(e)}", warnings=shown,
                                        seconds=fsdp.seconds)
    obs = dict(base, groups=tuple(groups), registrations=tuple(regs), missing=tuple(missing), calls=tuple(calls),
               warnings=shown)
    if any(c.error for c in calls):
        return FSDP2Observation(**obs, ties_intact=_ties(built.model, aliases), seconds=fsdp.seconds)
    ran, berr = False, None
    if loss is not None and loss.requires_grad:
        try:
            with fsdp.timing():
                loss.backward()
            ref_loss.backward()
            ran = True
        except Exception as e:
            berr = error_line(e)
    with fsdp.timing():
        grads, rerr = _read_grads(built.model, ref.model, initial) if berr is None else ((), None)
    return FSDP2Observation(**obs, backward_ran=ran, backward_error=berr, grads=grads, read_error=rerr,
                            ties_intact=_ties(built.model, aliases), seconds=fsdp.seconds)
