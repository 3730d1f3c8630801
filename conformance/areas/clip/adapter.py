"""CLIP-NORM and CLIP-GRADS: one backward under FSDP1 or FSDP2 on data that
differs by rank, the gradients clipped as the case's plan says, against
single-process clipping of the same model on the mean loss over every
rank's data. The only code of the area that calls FSDP and torch.distributed."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from conformance.areas.clip.observation import ClipObservation
from conformance.areas.common import fsdp1_adapter as a1
from conformance.areas.common import fsdp2_adapter as a2
from conformance.areas.common.clipping import norm_agrees, reference_norm
from conformance.areas.common.fsdp2_adapter import error_line, full_tensor, full_tensors
from conformance.areas.common.observation import GradObservation
from conformance.areas.common.precision_adapter import wrap_kwargs
from conformance.areas.common.ranks import failed_ranks
from conformance.areas.common.support import placed, unchanged
from conformance.areas.common.training import reference_loss
from conformance.case.build import build, is_sharded, read_attr
from conformance.case.spec import CaseSpec, ClipPlan

# One backward and one clip against one process: the same arithmetic up to
# the order of a few sums (the reduce-scatter's mean, the norm's partial
# sums); atol is scaled by each gradient's own size.
CLIP_RTOL, CLIP_ATOL = 1e-4, 1e-5
# Under mixed precision FSDP's gradients are a bf16 pipeline's, not the fp32
# reference's: clipping is then judged against the gradients FSDP itself
# holds before the clip, gathered whole (the docstrings' "norm over all
# gradients"), to fp32 rounding, or to bf16 rounding of a value returned or
# scaled in bf16 (FSDP1's keep_low_precision_grads).
BF16_RTOL = 2.0 ** -7


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
    mp = wrap_kwargs(spec, plan.precision)
    t0 = time.perf_counter()
    try:
        if spec.plan.api == "fsdp1":
            model = a1.wrap(spec, built, **mp)
        else:
            a2.shard(spec, built, extra=mp)
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
    own = None  # under mixed precision: {canonical FQN (or flat key): full gradient} before clipping
    if plan.precision is not None:
        gather_error = None
        try:
            own = _own_grads(spec, model, built.model, list(built.model.parameters()), aliases)
        except Exception as e:  # FSDP1's summon_full_params(with_grads=True) (its documented way)
            gather_error = error_line(e)
        if failed_ranks(gather_error is not None):
            # FSDP's state after a raise inside its unshard is not to be trusted: nothing more runs
            return ClipObservation(**common, gather_error=gather_error, failed=True, seconds=time.perf_counter() - t0)
        own_norm = reference_norm([g for f, g in own.items() if f in set(clipped)], norm_type)
        common["own_norm"] = own_norm
    empty = _empty_local(spec, model, built.model, params, aliases, {f: t.numel() for f, t in initial.items()})
    call = True
    if plan.way != "fsdp1-method":
        probe_failed = _local_probe([p.grad for p in params if p.grad is not None], norm_type, plan.foreach)
        n = failed_ranks(probe_failed)
        call = probe_failed or not 0 < n < world
    clip_error = None
    norm = None
    norm_dtensor = False
    norm_dtype = None
    grad_dtypes = {str(p.grad.dtype).removeprefix("torch.") for p in (params or model.parameters()) if p.grad is not None}
    if call:
        try:
            total = _clip(plan, model, params, max_norm, norm_type)
            norm_dtensor = is_sharded(total)
            norm_dtype = str(total.dtype).removeprefix("torch.")
            norm = _norm_value(total)
        except Exception as e:
            clip_error = error_line(e)
    fsdp_seconds = time.perf_counter() - t0
    failed = failed_ranks(clip_error is not None or not call) > 0
    obs = dict(common, clip_error=clip_error, peer_failed=not call, failed=failed, norm=norm, norm_dtensor=norm_dtensor,
               norm_dtype=norm_dtype, grad_dtypes=tuple(sorted(grad_dtypes)), empty_local=empty, fsdp_seconds=fsdp_seconds)
    if norm is not None:
        want, rtol = ref_norm, CLIP_RTOL
        if own is not None:
            want, rtol = own_norm, (CLIP_RTOL if norm_dtype == "float32" else BF16_RTOL)
        obs["norm_close"] = norm_agrees(norm, want, rtol, CLIP_ATOL)
    if failed:
        return ClipObservation(**obs, seconds=time.perf_counter() - t0)
    # the norm the clipped gradients are scaled by: max_norm / an overflowed
    # norm is inf / inf, nothing to compare them with
    obs["scale_finite"] = math.isfinite(ref_norm if own is None else own_norm)
    # the step with the clipped gradients and the read of its full values: FSDP's work too
    read_error = None
    t_read = time.perf_counter()
    try:
        if trainable:
            _sgd_step(model)
        final, grads_none = _final(spec, model, built.model, aliases, frozen)
    except Exception as e:
        read_error = f"full values: {error_line(e)}"
    obs["fsdp_seconds"] += time.perf_counter() - t_read
    if failed_ranks(read_error is not None) > 0:
        return ClipObservation(**obs, read_error=read_error or "another rank's step or read after the clip raised",
                               seconds=time.perf_counter() - t0)
    clipped_aliases = {f for f in final if aliases.param_canon.get(f, f) in set(clipped)}
    refs = dict(ref.model.named_parameters(remove_duplicate=False))
    out = []
    own_coef = None if own is None else min(1.0, max_norm / (own_norm + 1e-6))
    low = any(d != "float32" for d in grad_dtypes)
    for fqn, value in final.items():
        got = value - initial[fqn]
        canon_fqn = aliases.param_canon.get(fqn, fqn)
        if own is None:
            want = refs[fqn].detach() - initial[fqn]
        elif fqn in frozen:
            want = torch.zeros_like(got)
        elif canon_fqn in own:
            g = own[canon_fqn]
            want = -(g * own_coef) if fqn in clipped_aliases else -g
        else:  # never given a gradient: unchanged
            want = torch.zeros_like(got)
        scale = float(want.abs().max()) if want.numel() else 0.0
        rtol = BF16_RTOL if own is not None and low else CLIP_RTOL
        close = bool(torch.allclose(got, want, rtol=rtol, atol=CLIP_ATOL * max(1.0, scale)))
        diff = float((got - want).abs().max()) if want.numel() else 0.0
        out.append(GradObservation(fqn, False, False, close, diff, unchanged(value, initial[fqn])))
    return ClipObservation(**obs, params=tuple(out), frozen_grads_none=tuple(sorted(grads_none.items())),
                           seconds=time.perf_counter() - t0)


@torch.no_grad()
def _own_grads(spec: CaseSpec, model: nn.Module, inner: nn.Module, params, aliases) -> dict[str, torch.Tensor]:
    """The gradients FSDP holds (FSDP2: of ``params``), gathered whole on
    every rank (fp32 copies), by canonical FQN: FSDP2 each DTensor
    gradient's full_tensor(); FSDP1 with use_orig_params=True the original
    parameters' gradients under summon_full_params(with_grads=True); with
    False (the optimizer sees the flat parameters) the flat parameters'
    gradients all-gathered and cut at the original parameters' offsets (a1.flat_layout)
    (each alias once), and the parameters FSDP does not manage as they are."""
    out: dict[str, torch.Tensor] = {}
    if spec.plan.api == "fsdp2":
        names = {id(p): f for f, p in inner.named_parameters()}
        for p in params:
            if p.grad is not None:
                g = p.grad.full_tensor() if is_sharded(p.grad) else p.grad
                out[aliases.param_canon.get(names[id(p)], names[id(p)])] = g.detach().float().clone()
        return out
    if spec.plan.use_orig_params:
        # the original parameters' gradients (what the optimizer sees), whole:
        # summon_full_params(with_grads=True), its documented way
        with FSDP.summon_full_params(model, writeback=False, with_grads=True):
            for f, p in model.named_parameters():
                fqn = a1.clean(f)
                if p.grad is not None:
                    out.setdefault(aliases.param_canon.get(fqn, fqn), p.grad.detach().float().clone())
        return out
    from torch.distributed.fsdp._flat_param import FlatParameter

    for name, m in model.named_modules():
        handle = getattr(m, "_handle", None) if isinstance(m, FSDP) else None
        if handle is None or handle.flat_param.grad is None:
            continue
        fp, g = handle.flat_param, handle.flat_param.grad.detach()
        if handle.uses_sharded_strategy:
            full = torch.empty(g.numel() * dist.get_world_size(handle.process_group), dtype=g.dtype, device=g.device)
            dist.all_gather_into_tensor(full, g.contiguous(), group=handle.process_group)
            g = full
        prefix = a1.clean(name)
        offset, shapes = 0, iter(fp._shapes)
        for fqn, numel in a1.flat_layout(fp):
            if fqn is not None:
                full_fqn = f"{prefix}.{fqn}" if prefix else fqn
                out.setdefault(aliases.param_canon.get(full_fqn, full_fqn), g[offset:offset + numel].view(next(shapes)).float().clone())
            offset += numel
    for f, p in model.named_parameters():
        if not isinstance(p, FlatParameter) and p.grad is not None and not is_sharded(p):
            fqn = a1.clean(f)
            out.setdefault(aliases.param_canon.get(fqn, fqn), p.grad.detach().float().clone())
    return out


@torch.no_grad()
def _sgd_step(model: nn.Module) -> None:
    """SGD of lr 1 (p -= grad), as the reference's torch.optim.SGD does it;
    by hand because FSDP1's keep_low_precision_grads leaves bf16 gradients on
    fp32 parameters, which torch's optimizers do not promise to take."""
    for p in model.parameters():
        if p.requires_grad and p.grad is not None:
            p.add_(p.grad.to(p.dtype), alpha=-1.0)


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
    values = full_tensors({f: read_attr(inner, f) for f in names})
    none = {f: read_attr(inner, f).grad is None for f in names if f in frozen}
    return values, none
