"""PARITY: a few optimizer steps under FSDP1 or FSDP2 against single-process
training of the same model on the same data."""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.areas.common import fsdp1_adapter as a1
from conformance.areas.common import fsdp2_adapter as a2
from conformance.areas.common.fsdp2_adapter import error_line, full_tensors
from conformance.areas.common.observation import GradObservation
from conformance.areas.common.support import on_rank_device, placed, unchanged
from conformance.areas.common.training import NOISE_FACTOR, TRAIN_ATOL, TRAIN_RTOL, make_optimizer, noise, reference_loss, stable
from conformance.areas.parity.observation import TrainObservation
from conformance.case.build import build, read_attr
from conformance.case.model_case import ModelCase
from conformance.case.spec import CaseSpec, TrainPlan
from conformance.case.target import target_loss


def _batches(x0: torch.Tensor, step: int, world_size: int) -> list[torch.Tensor]:
    """One batch per rank, different on every rank: a gradient that is not
    reduced across ranks then differs from the reference's."""
    return [x0 * (1.0 + 0.25 * step) * (1.0 + 0.5 * r) for r in range(world_size)]


def _optimizer(plan: TrainPlan, model: nn.Module) -> torch.optim.Optimizer:
    """The plan's optimizer over the trainable parameters."""
    return make_optimizer(plan.optimizer, [p for p in model.parameters() if p.requires_grad], plan.lr)


def _train(model: nn.Module, x0: torch.Tensor, plan: TrainPlan, rank: int, world_size: int, *, reference: bool = False,
           totals: list[float] | None = None) -> list[float]:
    """Train on this rank's batches; the single-process ``reference`` trains
    on the mean loss over every rank's batch (the gradient FSDP's averaging
    reduction must produce), or with the plan's divide factor on their sum
    divided by it. The losses returned are this rank's batch's; ``totals``
    gets the reference's loss over every batch (the same on every rank:
    whether the reference diverged is judged on it)."""
    trainable = any(p.requires_grad for p in model.parameters())
    opt = _optimizer(plan, model) if trainable else None
    losses = []
    for step in range(plan.steps):
        if opt is not None:
            opt.zero_grad(set_to_none=True)  # before the step: the last step's grads stay to be read
        xs = _batches(x0, step, world_size)
        if reference:
            loss, per_rank = reference_loss(model, xs, plan.divide_factor)
            mine = per_rank[rank]
            if totals is not None:
                totals.append(float(loss.detach()))
        else:
            loss = mine = (model(xs[rank]) ** 2).sum()
        if opt is not None:  # everything frozen: forward only
            loss.backward()
            opt.step()
        losses.append(float(mine.detach()))
    return losses


def observe(spec: CaseSpec) -> TrainObservation:
    """PARITY on a generated case: each rank trains on its own batch, the
    reference on the mean loss over every rank's batch."""
    plan = spec.train or TrainPlan()
    rank, world = dist.get_rank(), dist.get_world_size()

    ref_totals: list[float] = []

    def steps(model: nn.Module, built, reference: bool) -> list[float]:
        return _train(model, built.example_input(), plan, rank, world, reference=reference, totals=ref_totals if reference else None)

    def reference64() -> dict[str, torch.Tensor]:
        ref64 = placed(build(spec))
        ref64.model.double()
        _train(ref64.model, ref64.example_input().double(), plan, rank, world, reference=True)
        return {f: p.detach() for f, p in ref64.model.named_parameters(remove_duplicate=False)}

    return compare_training(spec, steps, TRAIN_RTOL, TRAIN_ATOL, ref_totals, reference64)


def compare_training(case, steps, rtol: float, atol: float, ref_totals: list[float] | None = None,
                     reference64: Callable[[], dict[str, torch.Tensor]] | None = None) -> TrainObservation:
    """Wrap one copy of ``case``'s model as its plan says, leave another
    unsharded, run ``steps(model, built, reference)`` on both, and compare
    their losses and final parameters (every alias) within rtol/atol.
    ``ref_totals``: filled by the reference's ``steps`` with its losses over
    every rank's batch, on which its divergence is judged (default: the
    losses it returns, where those are the same on every rank).
    ``reference64``: the same reference training in float64, its final
    parameters; where a parameter is not within rtol/atol, the tolerance
    grows by NOISE_FACTOR times the fp32 reference's own distance from it
    (a gradient that is zero in exact arithmetic but rounding noise, as a
    LayerNorm over one element's weight has, moves a parameter by up to a
    whole lr under Adam, in a direction the noise picks: thorough seed 115
    had the fp32 reference 0.011-0.022 from fp64 there, FSDP 0.003-0.0096
    from fp32)."""
    base = dict(api=case.plan.api, rank=dist.get_rank(), world_size=dist.get_world_size(),
                backend=str(dist.get_backend()), torch_version=torch.__version__)
    built, ref = placed(build(case)), placed(build(case))
    aliases = a1.Aliases(built.model)
    initial = {f: p.detach().clone() for f, p in ref.model.named_parameters(remove_duplicate=False)}
    frozen = {f for f, p in ref.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    t0 = time.perf_counter()
    try:
        if case.plan.api == "fsdp1":
            model = a1.wrap(case, built)
        else:
            a2.shard(case, built)
            model = built.model
            train = getattr(case, "train", None)
            if train is not None and (train.force_sum or train.divide_factor is not None):
                a2.set_reduction(model, train.force_sum, train.divide_factor)
    except Exception as e:
        return TrainObservation(**base, wrap_error=error_line(e), seconds=time.perf_counter() - t0)
    try:
        losses = steps(model, built, False)
    except Exception as e:
        return TrainObservation(**base, step_error=error_line(e), seconds=time.perf_counter() - t0)
    fsdp_seconds = time.perf_counter() - t0
    ref_losses = steps(ref.model, ref, True)
    t_final = time.perf_counter()
    try:  # the trained model's full values: FSDP's work too (summon_full_params, full_tensor)
        final, grads_none = _final(case, model, built.model, aliases, frozen)
    except Exception as e:
        return TrainObservation(**base, step_error=f"full values: {error_line(e)}", seconds=time.perf_counter() - t0)
    fsdp_seconds += time.perf_counter() - t_final
    refs = dict(ref.model.named_parameters(remove_duplicate=False))
    close = {fqn: bool(torch.allclose(value, refs[fqn].detach(), rtol=rtol, atol=atol)) for fqn, value in final.items()}
    if reference64 is not None and not all(close.values()):
        floors = noise({f: refs[f] for f in close if not close[f]}, reference64())
        for fqn, floor in floors.items():
            value, want = final[fqn].detach().float(), refs[fqn].detach().float()
            close[fqn] = bool(((value - want).abs() <= atol + rtol * want.abs() + NOISE_FACTOR * floor).all())
    params = []
    for fqn, value in final.items():
        want = refs[fqn].detach()
        params.append(GradObservation(fqn, False, False, close[fqn], float((value - want).abs().max()), unchanged(value, initial[fqn])))
    losses_close = bool(torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol))
    return TrainObservation(
        **base, losses=tuple(losses), ref_losses=tuple(ref_losses), losses_close=losses_close,
        params=tuple(params), frozen_grads_none=tuple(sorted(grads_none.items())),
        ref_stable=stable(ref_totals or ref_losses, ref.model), seconds=time.perf_counter() - t0, fsdp_seconds=fsdp_seconds,
    )


def _final(spec: CaseSpec, model: nn.Module, inner: nn.Module, aliases, frozen: set[str]):
    """{FQN: final full value} for every alias, and {frozen FQN: grad is None}."""
    names = list(aliases.param_canon)
    if spec.plan.api == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, writeback=False):
            values = {f: read_attr(model, f).detach().clone() for f in names}
        none = {}
        if spec.plan.use_orig_params:  # with False, FSDP's parameters are flat: no per-parameter grad
            none = {a1.clean(f): p.grad is None for f, p in model.named_parameters() if a1.clean(f) in frozen}
        return values, none
    values = full_tensors({f: read_attr(inner, f) for f in names})
    none = {f: read_attr(inner, f).grad is None for f in names if f in frozen}
    return values, none




def _train_target(model: nn.Module, built, plan: TrainPlan, seed: int) -> list[float]:
    trainable = any(p.requires_grad for p in model.parameters())
    opt = _optimizer(plan, model) if trainable else None
    losses = []
    for step in range(plan.steps):
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        loss = target_loss(built.target, model(**on_rank_device(dict(built.target.inputs(seed + step)))))
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
    return compare_training(case, lambda model, built, reference: _train_target(model, built, plan, case.seed), TRAIN_RTOL, TRAIN_ATOL)
