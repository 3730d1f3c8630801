"""AC-PARITY, AC-STATE-DICT, AC-ALLGATHER: activation checkpointing applied
to a case's modules before FSDP1 wraps or FSDP2 shards it (torchtitan's
order), a few SGD steps on data that differs by rank against
single-process training without AC, the state dict's keys, and the
parameter all-gathers of every step (and of the same FSDP run without AC).
The only code of the area that calls FSDP, the checkpointing APIs and
torch.distributed."""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections import Counter
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from conformance.areas.activation_checkpointing.observation import ACObservation
from conformance.areas.activation_checkpointing.oracle import FREED_READ, RESHARDED_READ
from conformance.areas.common import fsdp1_adapter as a1
from conformance.areas.common import fsdp2_adapter as a2
from conformance.areas.common.comm_adapter import Recorder, fsdp2_patches
from conformance.areas.common.fsdp2_adapter import error_line, full_tensors
from conformance.areas.common.observation import GradObservation
from conformance.areas.common.ranks import any_rank_failed
from conformance.areas.common.support import placed, unchanged
from conformance.areas.common.training import TRAIN_ATOL, TRAIN_RTOL, make_optimizer, reference_loss, stable
from conformance.case.build import Built, build, read_attr
from conformance.case.spec import ActivationCheckpointPlan, CaseSpec

WRAPPER_PREFIX = "_checkpoint_wrapped_module."
LR = 0.05


def _save_tanh(ctx, op, *args, **kwargs):
    """Selective AC's policy: keep tanh's outputs, recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.tanh.default else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(plan: ActivationCheckpointPlan, built: Built) -> None:
    """Checkpoint each target the plan's way, before FSDP. ``built.modules``
    keeps the inner modules (FSDP's plan still names them)."""
    from torch.distributed._composable import checkpoint as composable_checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    for path in plan.targets:
        m = built.modules[path]
        if plan.kind in ("wrapper-non-reentrant", "wrapper-reentrant"):
            impl = CheckpointImpl.REENTRANT if plan.kind == "wrapper-reentrant" else CheckpointImpl.NO_REENTRANT
            parent, _, name = path.rpartition(".")
            holder = built.modules[parent]
            holder._modules[name] = checkpoint_wrapper(holder._modules[name], checkpoint_impl=impl)
        elif plan.kind == "composable":
            composable_checkpoint(m)
        else:
            kwargs: dict = {"use_reentrant": False}
            if plan.kind == "selective":
                kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _save_tanh)
            m.forward = functools.partial(checkpoint, m.forward, **kwargs)


def guard_freed_reads(built: Built) -> dict[int, object]:
    """Before FSDP: a forward pre-hook on every module of the case that
    raises where one of its parameters (or the view FSDP1 put in its
    place) has elements but a freed storage (size 0), or where it is not of
    its own shape (FSDP1 use_orig_params=True puts a 1-D view of the rank's
    shard in the parameter when it reshards): the read of a parameter FSDP
    already resharded. Unguarded, the kernel reads freed memory: garbage
    values or a segfault (seed 15: a reentrant recompute after its unit's
    early post-backward, fsdp1-reentrant-checkpoint-frees-unit-early), which
    in the in-process fake tier kills the test process; or the shard, which
    raises a shape error that differs by rank and module, or, shaped right
    by chance, computes with the wrong values (seed 35). Installed on the
    models with and without AC alike (a read that fails without AC too is
    FSDP's, not checkpointing's).

    The shape alone differs by rank: a 1-D parameter whose elements all lie
    in one rank's shard keeps its shape there, so that rank would go on into
    the next collective while the others raise, and the ranks hang (seed 81).
    Returns the owners map (id of a parameter -> its FSDP1 FlatParamHandle,
    filled after wrapping by note_fsdp1_owners): a parameter whose handle is
    sharded (a padded shard's size, the same on every rank) is a resharded
    read on every rank at once."""
    owners: dict[int, object] = {}
    for path, mod in built.modules.items():
        shapes = {n: tuple(p.shape) for n, p in mod._parameters.items() if p is not None}
        if not shapes:
            continue

        def check(m, args, __path=path, __shapes=shapes):
            for n, shape in __shapes.items():
                t = getattr(m, n, None)
                if type(t) not in (torch.Tensor, nn.Parameter):
                    continue
                fqn = (__path + "." if __path else "") + n
                if t.numel() and t.untyped_storage().size() == 0:
                    raise RuntimeError(f"{fqn} {FREED_READ} (numel {t.numel()}, storage of size 0)")
                # the handle's state, the same on every rank, decides first; the
                # shape (a shard's differs by rank) where FSDP1 holds no handle
                # for it; the message names no shard, the same on every rank
                handle = owners.get(id(t))
                if (handle is not None and handle.is_sharded(handle.flat_param)) or tuple(t.shape) != shape:
                    raise RuntimeError(f"{fqn} {RESHARDED_READ}, not its {list(shape)} parameter")

        mod.register_forward_pre_hook(check)
    return owners


def note_fsdp1_owners(model: nn.Module, owners: dict[int, object]) -> None:
    """Each FSDP1 use_orig_params=True parameter (tied names included) to
    the handle whose flat parameter holds it (guard_freed_reads)."""
    for unit in FSDP.fsdp_modules(model):
        handle = unit._handle
        if handle is None:
            continue
        fp = handle.flat_param
        for p in (*(fp._params or ()), *(fp._shared_params or ())):
            owners[id(p)] = handle


class Calls:
    """How often each checkpointed module's own forward runs, per step and
    phase: counted by a wrapper of its forward, installed before the
    checkpointing (which then checkpoints the counting forward), so that a
    recompute in backward counts as a call in the backward phase."""

    def __init__(self):
        self.phase = "forward"
        self.step = 0
        self.counts: Counter = Counter()

    def install(self, built: Built, targets: tuple[str, ...], saved: bool = False) -> None:
        """``saved``: also count the tensors autograd saves for backward
        inside each call (the same case without checkpointing: the regions
        whose activations checkpointing must recompute)."""
        for path in targets:
            m = built.modules[path]
            inner = m.forward

            def counted(*args, __path=path, __inner=inner, **kwargs):
                self.counts[(self.step, __path, self.phase)] += 1
                if not saved:
                    return __inner(*args, **kwargs)

                def pack(t, __key=(self.step, __path, "saved")):
                    self.counts[__key] += 1
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    return __inner(*args, **kwargs)

            m.forward = counted

    def saved(self, step: int, target: str) -> int:
        return self.counts[(step, target, "saved")]

    def rows(self, targets: tuple[str, ...], steps: int) -> tuple[tuple[int, str, int, int], ...]:
        """(step, target, forward calls, backward calls) for every step and target."""
        return tuple((s, t, self.counts[(s, t, "forward")], self.counts[(s, t, "backward")], self.counts[(s, t, "saved")])
                     for s in range(steps) for t in targets)


def _batches(x0: torch.Tensor, step: int, world: int) -> list[torch.Tensor]:
    """One batch per rank and step, each different (requiring grad: the
    reentrant variant computes no parameter gradient for a region none of
    whose inputs requires grad, the torch.utils.checkpoint docstring says)."""
    return [(x0 * (1.0 + 0.25 * step) * (1.0 + 0.5 * r)).requires_grad_(True) for r in range(world)]


def _wrap(spec: CaseSpec, built: Built) -> nn.Module:
    if spec.plan.api == "fsdp1":
        return a1.wrap(spec, built)
    a2.shard(spec, built)
    return built.model


def fsdp1_patches(rec: Recorder, units: dict[int, str]):
    """FSDP1's _unshard, owning the collectives it issues by the unit whose
    flat parameter it all-gathers (``units``: id(handle) -> canonical path;
    a prefetch unshards another unit's): every FSDP1 parameter all-gather,
    in forward, backward or a recomputed forward, goes through it."""
    from torch.distributed.fsdp import _runtime_utils as ru

    orig = ru._unshard

    def _unshard(state, handle, *args, **kwargs):
        with rec.owning(units.get(id(handle), "?")):
            return orig(state, handle, *args, **kwargs)

    return (mock.patch.object(ru, "_unshard", _unshard),)


def fsdp1_units(model: nn.Module, aliases) -> dict[int, str]:
    """id(handle) -> the canonical path of the module FSDP1 wraps (the
    checkpointed module where FSDP1 wrapped its CheckpointWrapper)."""
    out = {}
    for u in FSDP.fsdp_modules(model):
        if getattr(u, "_handle", None) is not None:
            inner = u.module
            inner = inner.__dict__.get("_modules", {}).get("_checkpoint_wrapped_module", inner)
            out[id(u._handle)] = aliases.canon_of_module.get(id(inner), "?")
    return out


def _gathers(rec: Recorder, step: int, api: str) -> list[tuple[int, str, str, int]]:
    seen = rec.take(True)
    c = Counter((x.phase, x.group.split(", ")[0] if api == "fsdp2" else x.group) for x in seen.collectives if x.op == "all_gather")
    return [(step, phase, group, n) for (phase, group), n in sorted(c.items())]


def _train(spec: CaseSpec, model: nn.Module, x0: torch.Tensor, steps: int, rank: int, world: int, labels: dict[int, str] | None,
           *, reference: bool = False, calls: Calls | None = None,
           totals: list[float] | None = None) -> tuple[list[float], list[tuple[int, str, str, int]]]:
    """SGD steps (every parameter that trains); each step's parameter
    all-gathers by group or unit (``labels``: FSDP2's module ids, FSDP1's
    handle ids -> canonical paths; None: not attributed). The losses are
    this rank's batch's; ``totals`` gets the reference's loss over every
    batch (the same on every rank: its divergence is judged on it)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer("SGD", trainable, LR) if trainable else None
    rec = Recorder()
    patches = ()
    if labels is not None and not reference:
        patches = fsdp2_patches(rec, labels) if spec.plan.api == "fsdp2" else fsdp1_patches(rec, labels)
    losses, gathers = [], []
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        for step in range(steps):
            xs = _batches(x0, step, world)
            if reference:
                loss, per_rank = reference_loss(model, xs)
                mine = per_rank[rank]
                if totals is not None:
                    totals.append(float(loss.detach()))
            else:
                rec.phase = "forward"
                if calls is not None:
                    calls.step, calls.phase = step, "forward"
                with rec.mode:
                    loss = mine = (model(xs[rank]).float() ** 2).sum()
            rec.phase = "backward"
            if calls is not None:
                calls.phase = "backward"
            with rec.mode if not reference else contextlib.nullcontext():
                loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(float(mine.detach()))
            if not reference:
                gathers += _gathers(rec, step, spec.plan.api)
    return losses, gathers


def _clean(name: str) -> str:
    return a1.clean(name).replace(WRAPPER_PREFIX, "")


def _final(spec: CaseSpec, model: nn.Module, inner: nn.Module, names: list[str], frozen: set[str]):
    """{FQN: full value} for every alias, and {frozen FQN: grad is None}."""
    if spec.plan.api == "fsdp1":
        with FSDP.summon_full_params(model, writeback=False):
            values = {f: read_attr(model, f).detach().clone() for f in names}
        none = {}
        if spec.plan.use_orig_params:  # with False, FSDP's parameters are flat: no per-parameter grad
            none = {_clean(f): p.grad is None for f, p in model.named_parameters() if _clean(f) in frozen}
        return values, none
    values = full_tensors({f: read_attr(inner, f) for f in names})
    none = {f: read_attr(inner, f).grad is None for f in names if f in frozen}
    return values, none


def _plain_error(spec: CaseSpec, model: nn.Module, x0: torch.Tensor, steps: int, rank: int, world: int) -> str | None:
    """Whether the same FSDP training without AC raises too (then the
    failure is FSDP's, not checkpointing's)."""
    error = None
    try:
        _train(spec, model, x0, steps, rank, world, None)
    except Exception as e:
        error = error_line(e)
    if any_rank_failed(error is not None):
        return error or "another rank's training without AC raised"
    return None


def observe(spec: CaseSpec) -> ACObservation:
    plan = spec.activation_checkpoint or ActivationCheckpointPlan()
    rank, world = dist.get_rank(), dist.get_world_size()
    base = dict(api=spec.plan.api, rank=rank, world_size=world, backend=str(dist.get_backend()), torch_version=torch.__version__)
    built, ref, plain = placed(build(spec)), placed(build(spec)), placed(build(spec))
    aliases, plain_aliases = a1.Aliases(built.model), a1.Aliases(plain.model)
    names = list(aliases.param_canon)
    base["plain_keys"] = tuple(sorted(ref.model.state_dict()))
    frozen = {f for f, p in ref.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    initial = {f: p.detach().clone() for f, p in ref.model.named_parameters(remove_duplicate=False)}
    x0 = built.example_input()
    t0 = time.perf_counter()
    error = None
    calls, plain_calls = Calls(), Calls()
    try:
        owners = guard_freed_reads(built)
        plain_owners = guard_freed_reads(plain)
        calls.install(built, plan.targets)
        plain_calls.install(plain, plan.targets, saved=True)
        apply_ac(plan, built)
    except Exception as e:
        error = error_line(e)
    if any_rank_failed(error is not None):
        return ACObservation(**base, ac_error=error or "another rank's checkpointing raised")
    try:
        model = _wrap(spec, built)
        plain_model = _wrap(spec, plain)
    except Exception as e:
        error = error_line(e)
    if any_rank_failed(error is not None):
        return ACObservation(**base, wrap_error=error or "another rank's wrapping raised")
    if spec.plan.api == "fsdp1":
        note_fsdp1_owners(model, owners)
        note_fsdp1_owners(plain_model, plain_owners)
    fsdp2 = spec.plan.api == "fsdp2"
    labels = aliases.canon_of_module if fsdp2 else fsdp1_units(model, aliases)
    losses: list[float] = []
    gathers: list = []
    try:
        losses, gathers = _train(spec, model, x0, plan.steps, rank, world, labels, calls=calls)
    except Exception as e:
        error = error_line(e)
    if any_rank_failed(error is not None):
        return ACObservation(**base, step_error=error or "another rank's training raised", plain_error=_plain_error(spec, plain_model, x0, plan.steps, rank, world))
    fsdp_seconds = time.perf_counter() - t0
    plain_gathers, plain_error = None, None
    t_plain = time.perf_counter()
    try:
        plain_labels = plain_aliases.canon_of_module if fsdp2 else fsdp1_units(plain_model, plain_aliases)
        plain_gathers = tuple(_train(spec, plain_model, x0, plan.steps, rank, world, plain_labels, calls=plain_calls)[1])
    except Exception as e:  # without AC it is FSDP's own failure (other areas'): recorded, not AC's
        plain_error = error_line(e)
    # the same FSDP run without AC is FSDP's work too (its wrapping is counted above)
    fsdp_seconds += time.perf_counter() - t_plain
    if any_rank_failed(plain_error is not None):
        plain_gathers, plain_error = None, plain_error or "another rank's training without AC raised"
    fake = base["backend"] == "fake"
    ref_totals: list[float] = []
    ref_losses: list[float] = []
    if not fake:  # the fake group's collectives carry no data: no values to compare (AC-PARITY: VALUES_UNCHECKED)
        ref_losses, _ = _train(spec, ref.model, x0, plan.steps, rank, world, None, reference=True, totals=ref_totals)
    # the trained model's full values: FSDP's work too (summon_full_params,
    # full_tensor), read on both tiers (a raise there is the training's; the
    # frozen parameters' grad None is structure)
    t_read = time.perf_counter()
    try:
        final, grads_none = _final(spec, model, built.model, names, frozen)
    except Exception as e:
        error = f"full values: {error_line(e)}"
    fsdp_seconds += time.perf_counter() - t_read
    if any_rank_failed(error is not None):
        if plain_error is None:  # the same read of the model trained without AC
            try:
                _final(spec, plain_model, plain.model, names, frozen)
            except Exception as e:
                plain_error = f"full values: {error_line(e)}"
            if any_rank_failed(plain_error is not None):
                plain_error = plain_error or "another rank's read of the values trained without AC raised"
        return ACObservation(**base, step_error=error or "another rank's read of the trained values raised", plain_error=plain_error)
    params = []
    if not fake:  # against the reference's trained values
        refs = dict(ref.model.named_parameters(remove_duplicate=False))
        for fqn, value in final.items():
            want = refs[fqn].detach()
            close = bool(torch.allclose(value, want, rtol=TRAIN_RTOL, atol=TRAIN_ATOL))
            diff = float((value - want).abs().max()) if want.numel() else 0.0
            params.append(GradObservation(fqn, False, False, close, diff, unchanged(value, initial[fqn])))
    keys: tuple[str, ...] = ()
    t_sd = time.perf_counter()
    try:
        keys = tuple(sorted(model.state_dict()))
    except Exception as e:
        error = re.sub(r"\brank=\d+", "rank=<r>", error_line(e))  # FSDP1's assertion names the rank
    fsdp_seconds += time.perf_counter() - t_sd
    if any_rank_failed(error is not None):
        error = error or "another rank's state_dict raised"
    return ACObservation(
        **base, state_dict_error=error, losses=tuple(losses), ref_losses=tuple(ref_losses),
        losses_close=None if fake else bool(torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=TRAIN_RTOL, atol=TRAIN_ATOL)),
        params=tuple(params), frozen_grads_none=tuple(sorted(grads_none.items())), ref_stable=fake or stable(ref_totals, ref.model),
        state_dict_keys=keys, gathers=tuple(gathers), plain_gathers=plain_gathers, plain_error=plain_error,
        calls=calls.rows(plan.targets, plan.steps), plain_calls=plain_calls.rows(plan.targets, plan.steps),
        seconds=time.perf_counter() - t0, fsdp_seconds=fsdp_seconds,
    )
