"""CLIP-NORM and CLIP-GRADS: one backward under FSDP1 or FSDP2 on data that
differs by rank, the gradients clipped as the case's plan says, against
single-process clipping of the same model on the mean loss over every
rank's data. The only code of the area that calls FSDP and torch.distributed."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from conformance.areas.clip.observation import ClipObservation
from conformance.areas.common import fsdp1_adapter as a1
from conformance.areas.common import fsdp2_adapter as a2
from conformance.areas.common.fsdp2_adapter import error_line, full_tensor
from conformance.areas.common.observation import GradObservation
from conformance.areas.common.ranks import failed_ranks
from conformance.areas.common.support import placed
from conformance.areas.common.training import reference_loss
from conformance.case.build import build, is_sharded, read_attr
from conformance.case.spec import CaseSpec, ClipPlan

# One backward and one clip against one process: the same arithmetic up to
# the order of a few sums (the reduce-scatter's mean, the norm's partial
# sums); atol is scaled by each gradient's own size.
CLIP_RTOL, CLIP_ATOL = 1e-4, 1e-5


def missing_api() -> str | None:
    """Why this torch cannot run the plan's clipping, or None
    (get_total_norm and clip_grads_with_norm_ came in 2.6)."""
    utils = torch.nn.utils
    if not all(hasattr(utils, n) for n in ("get_total_norm", "clip_grads_with_norm_")):
        return f"torch {torch.__version__} has no torch.nn.utils.get_total_norm / clip_grads_with_norm_"
    return None


def _batches(x0: torch.Tensor, world: int) -> list[torch.Tensor]:
    """One batch per rank, different on every rank: a norm that misses a
    rank's reduction, or counts it per rank, then differs from the reference's."""
    return [x0 * (1.0 + 0.5 * r) for r in range(world)]


def _clipped(model: nn.Module, plan: ClipPlan) -> list[nn.Parameter]:
    """The parameters the plan clips (each once, as Module.parameters() gives them)."""
    root = model if plan.subset is None else model.get_submodule(plan.subset)
    return list(root.parameters())


def _ignored(spec: CaseSpec, model: nn.Module) -> list[nn.Parameter]:
    """The parameters the plan tells FSDP to ignore, before wrapping."""
    out: dict[int, nn.Parameter] = {}
    for path in spec.plan.ignored_modules:
        out.update((id(p), p) for p in model.get_submodule(path).parameters())
    for f in spec.plan.ignored_params:
        p = model.get_parameter(f)
        out[id(p)] = p
    return list(out.values())


def reference_norm(grads: list[torch.Tensor], norm_type: float) -> float:
    """The single-process total norm, by its definition rather than by the
    clip_grad functions under test: the norm of every gradient flattened
    into one vector (0 for none)."""
    if not grads or not any(g.numel() for g in grads):
        return 0.0
    return float(torch.linalg.vector_norm(torch.cat([g.detach().flatten().float() for g in grads]), norm_type))


def _norm_value(t) -> float:
    return float(full_tensor(t.detach()))


def _local_probe(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> bool:
    """Whether the rank-local part of the norm raises on this rank: the
    same function on the local shards, with no collective. A rank whose
    clip raises before its reduction leaves the others waiting in it; they
    learn of it from here and do not call."""
    local = [g.to_local() if is_sharded(g) else g for g in grads]
    try:
        torch.nn.utils.get_total_norm(local, norm_type, foreach=foreach)
    except Exception:  # noqa: BLE001 - any error: the real call raises where it runs
        return True
    return False


def _clip(plan: ClipPlan, model: nn.Module, params: list[nn.Parameter], max_norm: float, norm_type: float):
    if plan.way == "fsdp1-method":
        return model.clip_grad_norm_(max_norm, norm_type)
    if plan.way == "clip_grad_norm_":
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, foreach=plan.foreach)
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type, foreach=plan.foreach)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=plan.foreach)
    return total


def observe(spec: CaseSpec) -> ClipObservation:
    plan = spec.clip or ClipPlan()
    norm_type = float(plan.norm_type)
    rank, world = dist.get_rank(), dist.get_world_size()
    base = dict(api=spec.plan.api, rank=rank, world_size=world, backend=str(dist.get_backend()), torch_version=torch.__version__)
    built, ref = placed(build(spec)), placed(build(spec))
    aliases = a1.Aliases(built.model)
    xs = _batches(built.example_input(), world)
    initial = {f: p.detach().clone() for f, p in ref.model.named_parameters(remove_duplicate=False)}
    frozen = {f for f, p in ref.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    canon = {id(p): f for f, p in reversed(list(ref.model.named_parameters(remove_duplicate=False)))}

    # the reference: single-process clipping on the mean loss over every rank's
    # batch, by the documented formula (max_norm / (norm + 1e-6), clamped at 1)
    trainable = any(p.requires_grad for p in ref.model.parameters())
    loss, _ = reference_loss(ref.model, xs)
    if trainable:
        loss.backward()
    ref_params = _clipped(ref.model, plan)
    clipped = tuple(canon[id(p)] for p in ref_params if p.requires_grad)
    ref_grads = [p.grad for p in ref_params if p.grad is not None]
    ref_norm = reference_norm(ref_grads, norm_type)
    max_norm = plan.fraction * ref_norm
    coef = min(1.0, max_norm / (ref_norm + 1e-6))
    for g in ref_grads:
        g.mul_(coef)
    if trainable:
        torch.optim.SGD([p for p in ref.model.parameters() if p.requires_grad], lr=1.0).step()
    common = dict(base, ref_norm=ref_norm, max_norm=max_norm, clipped=clipped)

    ignored = _ignored(spec, built.model)
    t0 = time.perf_counter()
    try:
        if spec.plan.api == "fsdp1":
            model = a1.wrap(spec, built)
        else:
            a2.shard(spec, built)
            model = built.model
    except Exception as e:
        return ClipObservation(**common, wrap_error=error_line(e), seconds=time.perf_counter() - t0)
    step_error = None
    try:
        if trainable:
            (model(xs[rank]) ** 2).sum().backward()
        # FSDP leaves ignored parameters' gradients to the user: averaged
        # here as data-parallel training does, so that the reference holds
        for p in ignored:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
    except Exception as e:
        step_error = error_line(e)
    if failed_ranks(step_error is not None):
        return ClipObservation(**common, step_error=step_error, failed=True, seconds=time.perf_counter() - t0)

    params = [] if plan.way == "fsdp1-method" else _clipped(built.model, plan)
    empty = _empty_local(spec, model, built.model, params, aliases, {f: t.numel() for f, t in initial.items()})
    call = True
    if plan.way != "fsdp1-method":
        probe_failed = _local_probe([p.grad for p in params if p.grad is not None], norm_type, plan.foreach)
        n = failed_ranks(probe_failed)
        call = probe_failed or not 0 < n < world
    clip_error = None
    norm = None
    norm_dtensor = False
    if call:
        try:
            total = _clip(plan, model, params, max_norm, norm_type)
            norm_dtensor = is_sharded(total)
            norm = _norm_value(total)
        except Exception as e:
            clip_error = error_line(e)
    fsdp_seconds = time.perf_counter() - t0
    failed = failed_ranks(clip_error is not None or not call) > 0
    obs = dict(common, clip_error=clip_error, peer_failed=not call, failed=failed, norm=norm, norm_dtensor=norm_dtensor,
               empty_local=empty, fsdp_seconds=fsdp_seconds)
    if norm is not None:
        obs["norm_close"] = abs(norm - ref_norm) <= CLIP_RTOL * abs(ref_norm) + CLIP_ATOL
    if failed:
        return ClipObservation(**obs, seconds=time.perf_counter() - t0)
    if trainable:
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0).step()
    final, grads_none = _final(spec, model, built.model, aliases, frozen)
    refs = dict(ref.model.named_parameters(remove_duplicate=False))
    out = []
    for fqn, value in final.items():
        want = refs[fqn].detach() - initial[fqn]
        got = value - initial[fqn]
        scale = float(want.abs().max()) if want.numel() else 0.0
        close = bool(torch.allclose(got, want, rtol=CLIP_RTOL, atol=CLIP_ATOL * max(1.0, scale)))
        diff = float((got - want).abs().max()) if want.numel() else 0.0
        out.append(GradObservation(fqn, False, False, close, diff, bool(torch.equal(value, initial[fqn]))))
    return ClipObservation(**obs, params=tuple(out), frozen_grads_none=tuple(sorted(grads_none.items())),
                           seconds=time.perf_counter() - t0)


def _empty_local(spec: CaseSpec, model: nn.Module, inner: nn.Module, params, aliases, full: dict[str, int]) -> tuple[str, ...]:
    """Canonical FQNs of the clipped, trainable parameters whose local shard
    on this rank is empty while the parameter (``full``: FQN -> numel) is not."""
    if spec.plan.api == "fsdp2":
        names = {id(p): f for f, p in inner.named_parameters()}
        return tuple(sorted(aliases.param_canon[names[id(p)]] for p in params
                            if p.requires_grad and is_sharded(p) and p.numel() and not p.to_local().numel()))
    if not spec.plan.use_orig_params:  # flat shards: no per-parameter local tensor
        return ()
    out = set()
    for f, p in model.named_parameters():
        fqn = aliases.param_canon.get(a1.clean(f), a1.clean(f))
        if p.requires_grad and not p.numel() and full.get(fqn, 0):
            out.add(fqn)
    return tuple(sorted(out))


def _final(spec: CaseSpec, model: nn.Module, inner: nn.Module, aliases, frozen: set[str]):
    """{FQN: full value} for every alias, and {frozen FQN: grad is None}."""
    names = list(aliases.param_canon)
    if spec.plan.api == "fsdp1":
        with FSDP.summon_full_params(model, writeback=False):
            values = {f: read_attr(model, f).detach().clone() for f in names}
        none = {}
        if spec.plan.use_orig_params:  # with False, FSDP's parameters are flat: no per-parameter grad
            none = {a1.clean(f): p.grad is None for f, p in model.named_parameters() if a1.clean(f) in frozen}
        return values, none
    values = {f: full_tensor(read_attr(inner, f).detach()) for f in names}
    none = {f: read_attr(inner, f).grad is None for f in names if f in frozen}
    return values, none
