"""Adapters for a ModelCase (a real model from a Target): FSDP2 with the
target's forward and methods (e.g. generate) called against an unsharded
copy, and PARITY with the target's loss. FSDP1 wrapping needs nothing of its
own (conformance.adapters.fsdp1 builds the target through build())."""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.adapters import fsdp1 as a1
from conformance.adapters import fsdp2 as a2
from conformance.adapters.fsdp2 import _err, _group_states, _grads, _ties, count_collectives, fsdp2_api
from conformance.adapters.training import RTOL as TRAIN_RTOL
from conformance.adapters.training import ATOL as TRAIN_ATOL
from conformance.adapters.training import _optimizer, compare_training
from conformance.case.build import build
from conformance.adapters.support import on_rank_device, placed
from conformance.case.model_case import ModelCase
from conformance.observations import CallObservation, FSDP2Observation, RegistrationObservation, TrainObservation
from conformance.case.spec import TrainPlan
from conformance.case.target import default_loss, method_kwargs

RTOL, ATOL = a2.RTOL, a2.ATOL


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
        x, y = a2.full_tensor(x.detach()), a2.full_tensor(y.detach())
        if x.is_floating_point():
            close &= bool(torch.allclose(x, y, rtol=RTOL, atol=ATOL))
            diff = max(diff, float((x - y).abs().max()) if x.numel() else 0.0)
        else:
            close &= bool(torch.equal(x, y))
            diff = max(diff, float((x != y).sum()))
    return close, diff


def _base(api: str) -> dict:
    return dict(api=api, rank=dist.get_rank(), world_size=dist.get_world_size(),
                backend=str(dist.get_backend()), torch_version=torch.__version__)


def _loss(built, out):
    return (built.target.loss or default_loss)(out)


def observe_fsdp2(case: ModelCase) -> FSDP2Observation:
    """fully_shard the target's model as the plan says, register the drawn
    methods, call forward then each method; compare with an unsharded copy
    built from the same seed on this rank; backward through forward's loss."""
    _, FSDPModule, register_fsdp_forward_method = fsdp2_api()
    base = _base("fsdp2")
    built, ref = placed(build(case)), placed(build(case))
    aliases = a1.Aliases(built.model)
    initial = {f: p.detach().clone() for f, p in ref.model.named_parameters(remove_duplicate=False)}
    target = built.target
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            a2.shard(case, built)
        except Exception as e:  # a rejection is an observation
            return FSDP2Observation(**base, wrap_error=_err(e), seconds=time.perf_counter() - t0)
        groups = a2.observed_groups(built.model, aliases)
        ref_funcs = {m.name: a2._method_func(type(ref.model), m.name) for m in case.methods}
        regs = []
        for i, m in enumerate(case.methods):
            error = None
            if m.register:
                try:
                    register_fsdp_forward_method(built.model, m.name)
                except Exception as e:
                    error = _err(e)
            same = a2._method_func(type(ref.model), m.name) is ref_funcs[m.name] and m.name not in ref.model.__dict__
            regs.append(RegistrationObservation(i, isinstance(built.model, FSDPModule), m.name in built.model.__dict__, same, error))
        missing = a2.missing_names(case, built)
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
            with count_collectives() as comm:
                out = fn(**kwargs)
        except Exception as e:
            calls.append(CallObservation(index, call.method, 0, None, None, _err(e), _group_states(built.model, groups)))
            break
        want = ref_fn(**kwargs)
        close, diff = compare(out, want)
        calls.append(CallObservation(index, call.method, a2._allgathers(comm.get_comm_counts()), close, diff, None,
                                     _group_states(built.model, groups)))
        if call.method == -1:
            try:
                loss, ref_loss = _loss(built, out), _loss(ref, want)
            except Exception as e:
                return FSDP2Observation(**base, groups=tuple(groups), registrations=tuple(regs), missing=tuple(missing),
                                        calls=tuple(calls), backward_error=f"loss: {_err(e)}", warnings=shown,
                                        seconds=time.perf_counter() - t0)
    obs = dict(base, groups=tuple(groups), registrations=tuple(regs), missing=tuple(missing), calls=tuple(calls),
               warnings=shown)
    if any(c.error for c in calls):
        return FSDP2Observation(**obs, ties_intact=_ties(built.model, aliases), seconds=time.perf_counter() - t0)
    ran, berr = False, None
    if loss is not None and loss.requires_grad:
        try:
            loss.backward()
            ref_loss.backward()
            ran = True
        except Exception as e:
            berr = _err(e)
    grads = tuple(_grads(built.model, ref.model, initial)) if berr is None else ()
    return FSDP2Observation(**obs, backward_ran=ran, backward_error=berr, grads=grads,
                            ties_intact=_ties(built.model, aliases), seconds=time.perf_counter() - t0)


def _train(model: nn.Module, built, plan: TrainPlan, seed: int) -> list[float]:
    trainable = any(p.requires_grad for p in model.parameters())
    opt = _optimizer(plan, model.parameters()) if trainable else None
    losses = []
    for step in range(plan.steps):
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        loss = _loss(built, model(**on_rank_device(dict(built.target.inputs(seed + step)))))
        if opt is not None:
            loss.backward()
            opt.step()
        losses.append(float(loss.detach()))
    return losses


def observe_train(case: ModelCase) -> TrainObservation:
    """PARITY on a target: a few steps of the target's loss on its inputs
    (a new seed each step, the same on every rank) under FSDP1 or FSDP2,
    against the unsharded copy."""
    plan = case.train or TrainPlan()
    return compare_training(case, lambda model, built, reference: _train(model, built, plan, case.seed), TRAIN_RTOL, TRAIN_ATOL)
