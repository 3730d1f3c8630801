"""INIT-ORDER, INIT-META, INIT-SYNC and INIT-DIVERGENT: the case's user
actions around FSDP's lazy initialisation (state dicts and unshard() before
the first forward, the optimizer before or after it, model.to(dtype),
meta-device init, rank-seeded models synchronised from rank 0, a module one
rank does not call), then a few optimizer steps on data that differs by
rank, against single-process training. The only code of the area that
calls FSDP and torch.distributed."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from conformance.areas.common import fsdp1_adapter as a1
from conformance.areas.common import fsdp2_adapter as a2
from conformance.areas.common import stall
from conformance.areas.common.fsdp2_adapter import error_line, full_tensor, load_cause
from conformance.areas.common.ranks import any_rank_failed
from conformance.areas.common.support import add_rank_buffers, case_buffers, placed, rank_device
from conformance.areas.common.training import NOISE_FACTOR, TRAIN_ATOL, TRAIN_RTOL, make_optimizer, noise, reference_loss, stable
from conformance.areas.init_order.observation import InitObservation, ValueCheck
from conformance.case.build import Built, build, is_sharded, read_attr
from conformance.case.spec import REPLACE_SCALE, REPLACE_SHIFT, CaseSpec, InitPlan, replaced_parameter
from conformance.engine.fake import forget_meshes

LR = 0.05
# The buffers the sync cases add to every module of the case (the drawn
# trees hold few buffers, and none non-persistent): one persistent, one not,
# each different on every rank and module before the sync. On every module,
# not the root alone: FSDP1 syncs a unit's buffers with module.buffers(),
# those of the non-unit modules under it included, which only a buffer below
# the root shows (a root unit's own would be synced even by buffers(recurse=False)).
SYNC_BUFFERS = (("init_persistent", True), ("init_non_persistent", False))
SYNC_SALT = 1_000_003
# A rank-divergent case runs FSDP on a group of its own, watched by a
# StallGuard (conformance.areas.common.stall): once every rank has slept in
# a collective for a second without CPU, the guard closes the group and each
# rank's collective raises (a hang, seen in about a second). The group's
# timeout is the fallback (seconds; NCCL, ranks on several hosts): a hang
# then shows in seconds, not at the pool's deadline; long enough that a
# loaded machine (2 cores, the suite's other worker and its ranks) does not
# time out a collective that would complete (3 s did, on a mutant run's machine)
DIVERGENT_TIMEOUT = 8.0


def _replace(built: Built, fqn: str) -> None:
    """Register the parameter ``fqn`` anew, computed from its value (a
    DTensor of the same layout where fully_shard sharded it), as DoRA
    initialises its magnitudes: module.<name> = nn.Parameter(...)."""
    path, _, name = fqn.rpartition(".")
    module = built.modules[path]
    old = getattr(module, name)
    with torch.no_grad():
        new = old.detach() * REPLACE_SCALE + REPLACE_SHIFT
    setattr(module, name, nn.Parameter(new, requires_grad=old.requires_grad))


def _batches(x0: torch.Tensor, world: int) -> list[torch.Tensor]:
    """One batch per rank, different on every rank."""
    return [x0 * (1.0 + 0.5 * r) for r in range(world)]


def _set_skip(built: Built, path: str | None, on: bool) -> None:
    """Make the forward of ``path``'s parent pass over it (``on``) or call it."""
    if path is None:
        return
    parent, _, name = path.rpartition(".")
    built.modules[parent].__dict__["_case_skip"] = (name,) if on else ()


def _skipped_params(built: Built, path: str | None) -> tuple[str, ...]:
    if path is None:
        return ()
    return tuple(sorted(f"{path}.{n}" for n, p in built.modules[path].named_parameters() if p.requires_grad))


def _checks(names_values, want: dict[str, torch.Tensor], kind: str, exact: bool,
            floor: Callable[[], dict[str, torch.Tensor]] | None = None) -> list[ValueCheck]:
    """Each value against ``want``: equal, or (not ``exact``) within the
    training tolerance; where it is not, and ``floor`` gives the reference's
    noise (its float32 run's distance from float64), within NOISE_FACTOR
    times that on top, as PARITY judges."""
    out = []
    floors = None
    for name, got in names_values:
        w = want[name].to(device=got.device, dtype=got.dtype)
        diff = float((got - w).abs().max()) if got.numel() and got.shape == w.shape else (0.0 if got.shape == w.shape else math.inf)
        if exact:
            eq = got.shape == w.shape and bool(torch.equal(got, w))
        else:
            scale = float(w.abs().max()) if w.numel() else 0.0
            eq = got.shape == w.shape and bool(torch.allclose(got, w, rtol=TRAIN_RTOL, atol=TRAIN_ATOL * max(1.0, scale)))
            if not eq and floor is not None and got.shape == w.shape:
                floors = floor() if floors is None else floors
                bound = TRAIN_ATOL * max(1.0, scale) + TRAIN_RTOL * w.abs() + NOISE_FACTOR * floors.get(name, torch.zeros_like(w)).to(w.dtype)
                eq = bool(((got - w).abs() <= bound).all())
        out.append(ValueCheck(name, kind, eq, diff))
    return out


def _local_chunk(d0: int, world: int, rank: int) -> int:
    """The rows of dim 0 rank ``rank`` holds under fully_shard's Shard(0)
    (torch.chunk: ceil(d0 / world) each, the last ranks fewer or none)."""
    c = -(-d0 // world) if d0 else 0
    return max(0, min(c, d0 - rank * c))


def _distribute(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    try:
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    except TypeError:  # torch without src_data_rank: every rank holds the same full value anyway
        return distribute_tensor(full, like.device_mesh, like.placements)


def _reset(module: nn.Module, src: nn.Module) -> None:
    """The user's reset_parameters of one module after to_empty: its own
    parameters and buffers set to the non-meta model's (``src``, the same
    module of a model built on CPU from the same seed); a sharded parameter
    gets its shard of that value through the public DTensor API."""
    with torch.no_grad():
        for name, p in module._parameters.items():
            if p is None:
                continue
            full = src._parameters[name].detach().to(device=p.device, dtype=p.dtype)
            p.copy_(_distribute(full, p) if is_sharded(p) else full)
        for name, b in module._buffers.items():
            if b is not None and name in src._buffers:
                b.copy_(src._buffers[name].to(device=b.device, dtype=b.dtype))


def _action(model: nn.Module, name: str) -> None:
    if name == "state_dict":
        model.state_dict()
    elif name == "get_model_state_dict":
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        get_model_state_dict(model)
    else:
        _, FSDPModule, _ = a2.fsdp2_api()
        for m in model.modules():
            if isinstance(m, FSDPModule):
                if name == "unshard":
                    m.unshard()
                else:
                    handle = m.unshard(async_op=True)
                    if handle is not None:
                        handle.wait()


def _full_values(spec: CaseSpec, model: nn.Module, inner: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """{canonical FQN: full value} of every parameter (a collective: every rank calls it)."""
    if spec.plan.api == "fsdp1":
        with FSDP.summon_full_params(model, writeback=False):
            return {f: read_attr(model, f).detach().clone() for f in names}
    return {f: full_tensor(read_attr(inner, f).detach()).clone() for f in names}


def _shard_checks(inner: nn.Module, world: int, rank: int) -> tuple[tuple[str, ...], bool]:
    """FSDP2: parameters whose local shard is not fully_shard's dim-0 chunk,
    and whether some local shard on this rank is empty."""
    from torch.distributed.tensor import Shard

    bad, empty = [], False
    for f, p in inner.named_parameters():
        if not is_sharded(p):
            bad.append(f"{f}: not a DTensor")
            continue
        want = _local_chunk(p.shape[0], world, rank) if p.dim() else 0
        local = p.to_local()
        if tuple(p.placements) != (Shard(0),) or (p.dim() and (local.shape[0] != want or tuple(local.shape[1:]) != tuple(p.shape[1:]))):
            bad.append(f"{f}: local {tuple(local.shape)} {tuple(p.placements)}, want ({want}, ...) (Shard(dim=0),)")
        if p.dim() and p.shape[0] and not local.shape[0]:
            empty = True
    return tuple(bad), empty


def _reference(spec: CaseSpec, plan: InitPlan, world: int, dtype, train: bool = True):
    """Single-process training of the case (the seed's values), every
    rank's batch in each step's mean loss, rank 1's forward passing over
    ``plan.skip``: per-rank losses per step, final values, stability. Not
    ``train``: only the batches (the fake tier, whose collectives carry no
    data, compares no values)."""
    ref = placed(build(spec))
    if plan.replace:
        _replace(ref, replaced_parameter(spec))
    if dtype is not None:
        ref.model.to(dtype)
    xs = _batches(ref.example_input().to(dtype or torch.float32), world)
    if not train:
        return xs, [], {}, True
    params = [p for p in ref.model.parameters() if p.requires_grad]
    opt = make_optimizer(plan.optimizer, params, LR) if params else None
    calls = itertools.count()

    def forward(x):
        _set_skip(ref, plan.skip, next(calls) % world == 1)
        return ref.model(x)

    per_step, totals = [], []
    for _ in range(plan.steps):
        total, per_rank = reference_loss(forward, xs)
        per_step.append([float(v) for v in per_rank])
        totals.append(float(total))
        if opt is not None:
            total.backward()
            opt.step()
            opt.zero_grad()
    final = {f: p.detach().clone() for f, p in ref.model.named_parameters(remove_duplicate=False)}
    return xs, per_step, final, stable(totals, ref.model)


def observe(spec: CaseSpec) -> InitObservation:
    """The case on this rank. A rank-divergent case's group of its own is
    never torn down while its ranks live: every such example says its
    process groups are spent, and the pool starts fresh ranks after it
    (killed, not destroyed: a gloo group that one rank destroys while its
    peer's pairs are still open can abort that peer later, in another
    example)."""
    made: list = []
    obs = _observe(spec, made)
    return dataclasses.replace(obs, spent_process_groups=True) if made else obs


def _observe(spec: CaseSpec, made: list) -> InitObservation:
    plan = spec.init or InitPlan()
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend())
    base = dict(api=spec.plan.api, rank=rank, world_size=world, backend=backend, torch_version=torch.__version__)
    dtype = getattr(torch, plan.dtype) if plan.dtype else None
    t_start = time.perf_counter()
    fake = backend == "fake"
    xs, ref_per_step, ref_final, ref_ok = _reference(spec, plan, world, dtype, train=not fake)
    src = build(spec)  # the non-meta model of the same seed: what meta init and sync must give
    src_values = {f: p.detach().clone() for f, p in src.model.named_parameters(remove_duplicate=False)}
    common = dict(base, ref_losses=tuple(s[rank] for s in ref_per_step), ref_stable=ref_ok)

    seed = spec.seed + rank if plan.sync else spec.seed
    if plan.meta:
        with torch.device("meta"):
            built = build(spec)
    else:
        built = placed(build(dataclasses.replace(spec, seed=seed)))
    if plan.sync:
        add_rank_buffers(built, seed, SYNC_BUFFERS, SYNC_SALT)
    aliases = a1.Aliases(built.model)
    names = list(aliases.param_canon)
    frozen_or_not = [p for p in built.model.parameters()]
    trainable = any(p.requires_grad for p in frozen_or_not)
    skipped = _skipped_params(built, plan.skip)
    group, guard = None, contextlib.nullcontext()
    if plan.skip is not None and backend != "fake":
        group, fds = stall.new_group(datetime.timedelta(seconds=DIVERGENT_TIMEOUT))
        made.append(group)
        guard = stall.StallGuard(group, fds)
    rank0_sd = {k: v.detach().clone() for k, v in built.model.state_dict().items()} if plan.sync and spec.plan.api == "fsdp2" else None

    t0 = time.perf_counter()
    sync_error = init_error = None
    try:
        if spec.plan.api == "fsdp1":
            extra = {}
            if plan.sync:
                extra["sync_module_states"] = True
            if plan.meta:
                paths = built.module_paths()

                def param_init_fn(m: nn.Module) -> None:
                    m.to_empty(device=rank_device(), recurse=False)
                    if id(m) in paths:
                        _reset(m, src.modules[paths[id(m)]])

                extra["param_init_fn"] = param_init_fn
            if group is not None:
                extra["process_group"] = group
            model = a1.wrap(spec, built, **extra)
        else:
            if group is not None:
                from torch.distributed.device_mesh import DeviceMesh

                mesh = DeviceMesh.from_group(group, rank_device().type)
                # DTensor's sharding-propagation cache takes this mesh for an
                # equal one of an earlier example (the default group's: mesh
                # equality ignores groups), whose collectives then go there,
                # without this group's timeout: a missed one hung the pool
                # until its deadline (ci seed 81; conformance.engine.fake)
                forget_meshes()
                a2.shard(spec, built, extra=lambda _mods: {"mesh": mesh})
            else:
                a2.shard(spec, built)
            model = built.model
    except Exception as e:
        text = error_line(e)
        if plan.sync and spec.plan.api == "fsdp1":
            return InitObservation(**common, sync_error=text, failed=True, skipped_params=skipped, seconds=time.perf_counter() - t_start)
        if plan.meta and spec.plan.api == "fsdp1":
            return InitObservation(**common, init_error=text, failed=True, skipped_params=skipped, seconds=time.perf_counter() - t_start)
        return InitObservation(**common, wrap_error=text, failed=True, skipped_params=skipped, seconds=time.perf_counter() - t_start)

    untied_at_init = False
    if plan.meta and spec.plan.api == "fsdp1":  # internals: the flat parameters' unpadded sizes
        handles = [u._handle for u in FSDP.fsdp_modules(model) if getattr(u, "_handle", None) is not None]
        # the original parameters each flat parameter holds (_numels: alignment padding excluded)
        managed = sum(sum(h.flat_param._numels) for h in handles if h.flat_param is not None)
        untied_at_init = bool(spec.ties or spec.shared) and managed > sum(p.numel() for p in src.model.parameters())
    bad_shards, empty = ((), False)
    if spec.plan.api == "fsdp2":
        bad_shards, empty = _shard_checks(built.model, world, rank)
    if plan.meta and spec.plan.api == "fsdp2":
        try:
            model.to_empty(device=rank_device())
            for path, m in built.modules.items():
                _reset(m, src.modules[path])
        except Exception as e:
            init_error = error_line(e)
    if plan.sync and spec.plan.api == "fsdp2":
        try:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(model, rank0_sd if rank == 0 else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        except Exception as e:
            sync_error = error_line(e) + load_cause(e)  # load_state_dict's first line names only the module
    if any_rank_failed(init_error is not None or sync_error is not None):
        return InitObservation(**common, init_error=init_error, sync_error=sync_error, failed=True, bad_shards=bad_shards,
                               empty_shard=empty, skipped_params=skipped, seconds=time.perf_counter() - t_start)

    obs = dict(common, bad_shards=bad_shards, empty_shard=empty, skipped_params=skipped, untied_at_init=untied_at_init)
    action_error = None
    if plan.meta or plan.sync:
        # the initialised / synced model's full values: FSDP's work too (summon_full_params, full_tensor)
        read_error = None
        try:
            values = _full_values(spec, model, built.model, names)
        except Exception as e:
            read_error = f"full values: {error_line(e)}"
        if any_rank_failed(read_error is not None):
            read_error = read_error or "another rank's read of the full values raised"
            return InitObservation(**obs, init_error=read_error if plan.meta else None, sync_error=None if plan.meta else read_error,
                                   failed=True, seconds=time.perf_counter() - t_start)
        canon = [(f, values[f]) for f in names if aliases.param_canon[f] == f]
        checks = _checks(canon, src_values, "param", exact=True)
        src_bufs = {f: m._buffers[n] for f, m, n in case_buffers(src)}
        if plan.meta:
            checks += _checks([(f, m._buffers[n].detach()) for f, m, n in case_buffers(built) if f in src_bufs], src_bufs, "buffer",
                              exact=True)
            obs["meta_values"] = tuple(checks)
        else:
            # rank 0's values: what its seed gives (every rank can make them)
            want = add_rank_buffers(src, spec.seed, SYNC_BUFFERS, SYNC_SALT)
            persistent = dict(SYNC_BUFFERS)
            for f, m, n in case_buffers(built):
                if n in persistent and f in want:
                    kind = "buffer" if persistent[n] else "non-persistent-buffer"
                    checks += _checks([(f, m._buffers[n].detach())], want, kind, exact=True)
                elif f in src_bufs:
                    checks += _checks([(f, m._buffers[n].detach())], src_bufs, "buffer", exact=True)
            obs["sync_values"] = tuple(checks)

    if plan.replace:  # before the optimizer (it takes the new Parameter) and before lazy init
        try:
            _replace(built, replaced_parameter(spec))
        except Exception as e:
            action_error = f"replacing {replaced_parameter(spec)}: {error_line(e)}"
        if any_rank_failed(action_error is not None):
            return InitObservation(**obs, action_error=action_error or "another rank's replacement raised", failed=True,
                                   seconds=time.perf_counter() - t_start)

    # the optimizer (unless it comes after the first step's backward) while
    # the registered parameters are the sharded ones (FSDPModule.unshard /
    # reshard swap them), then the actions before the first forward, then training
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(plan.optimizer, params, LR) if params and not plan.optimizer_after_forward else None
    try:
        for a in plan.before:
            try:
                _action(model, a)
            except Exception as e:
                action_error = f"{a}: {error_line(e)}"
                raise
        if dtype is not None:
            model.to(dtype)
            obs["dtype_kept"] = all(is_sharded(p) and p.dtype == dtype for p in model.parameters())
    except Exception as e:
        action_error = action_error or f"to({plan.dtype}): {error_line(e)}"
    if any_rank_failed(action_error is not None):
        return InitObservation(**obs, action_error=action_error, failed=True, seconds=time.perf_counter() - t_start)

    _set_skip(built, plan.skip, rank == 1)
    losses: list[float] = []
    step_error = None
    final = None
    with guard:
        try:
            for _ in range(plan.steps):
                loss = (model(xs[rank]).float() ** 2).sum()
                losses.append(float(loss))
                if trainable:
                    loss.backward()
                    if opt is None:  # after the first forward and backward: FSDP is initialised
                        opt = make_optimizer(plan.optimizer, [p for p in model.parameters() if p.requires_grad], LR)
                    opt.step()
                    opt.zero_grad()
        except Exception as e:
            step_error = error_line(e)
        if step_error is None:
            try:  # a collective too: a rank that diverged may hang here
                final = _full_values(spec, model, built.model, names)
            except Exception as e:
                step_error = f"full values: {error_line(e)}"
    fsdp_seconds = time.perf_counter() - t0
    # whether some rank's guard closed the group (every rank asks: the ranks
    # whose collective then raised call it a hang, as a timeout)
    stalled = group is not None and any_rank_failed(guard.fired)
    if stalled and step_error is not None:
        step_error = (f"every rank slept in collectives of the example's group for {stall.STALL:g} s without CPU "
                      f"(the suite then closed the group; the collective raised: {step_error})")
    timed_out = step_error is not None and (stalled or "Timed out" in step_error or "Application timeout" in step_error)
    if any_rank_failed(step_error is not None):
        return InitObservation(**obs, step_error=step_error, timed_out=timed_out, failed=True, losses=tuple(losses),
                               seconds=time.perf_counter() - t_start, fsdp_seconds=fsdp_seconds)
    want = list(ref_per_step)

    def floor() -> dict[str, torch.Tensor]:
        """The float32 reference's own noise: its distance from the same training in float64."""
        return noise(ref_final, _reference(spec, plan, world, torch.float64)[2])

    floor = floor if dtype is None else None  # a float64 case's reference is its own float64 run
    close = None if fake else all(math.isclose(got, w[rank], rel_tol=TRAIN_RTOL, abs_tol=TRAIN_ATOL) for got, w in zip(losses, want))
    untied = tuple(sorted(f for f in names if aliases.param_canon[f] != f
                          and not torch.equal(final[f], final[aliases.param_canon[f]])))
    return InitObservation(**obs, losses=tuple(losses), losses_close=close, untied=untied,
                           final=() if fake else tuple(_checks([(f, final[f]) for f in names], ref_final, "param", exact=False, floor=floor)),
                           seconds=time.perf_counter() - t_start, fsdp_seconds=fsdp_seconds)
