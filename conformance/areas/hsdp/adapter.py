"""HSDP adapter: shard a built case over a (replicate, shard) layout (FSDP2's
fully_shard(mesh=2-D mesh); FSDP1's HYBRID_SHARD / _HYBRID_SHARD_ZERO2 given
a device_mesh or a process-group pair), train it a few steps on data that
differs by rank, and record what each rank holds (local shards, their
digests after every step, the collectives of every step); beside it the
same case as flat FSDP over the whole world and unsharded, and full state
dicts carried between HSDP and flat FSDP. The only module of the area that
touches FSDP internals (FSDP1's flat parameters' sizes)."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy

from conformance.areas.common import fsdp1_adapter as a1
from conformance.areas.common.comm_adapter import Recorder
from conformance.areas.common.fsdp2_adapter import error_line, fsdp2_api, full_tensor, load_cause
from conformance.areas.common.fsdp2_oracle import shard_order
from conformance.areas.common.ranks import any_rank_failed
from conformance.areas.common.support import add_rank_buffers, cached_layout, case_buffers, fsdp2_mesh, hsdp_mesh, placed
from conformance.areas.common.timing import Stopwatch
from conformance.areas.common.training import make_optimizer, reference_loss, reference_noise, stable, train_close
from conformance.areas.hsdp.observation import HsdpObservation, LocalSeen, StepSeen, ValueSeen
from conformance.case.build import build, is_sharded, local_part, read_attr
from conformance.case.spec import CaseSpec
from conformance.case.target import graph_of
from conformance.paths import scratch_dir

# the flat (1-D) FSDP1 strategy each hybrid one applies within its shard group
FLAT_STRATEGY = {"HYBRID_SHARD": "FULL_SHARD", "_HYBRID_SHARD_ZERO2": "SHARD_GRAD_OP"}

DCP_PREFIX = "fsdp-conformance-hsdp-"

def process_group_pair(shape: tuple[int, int]):
    """(shard group, replicate group) of this rank, as FSDP1's
    process_group=(intra_node_pg, inter_node_pg) takes them: the ranks of
    its row and of its column in the row-major (replicate, shard) grid."""
    r, s = shape

    def make():
        rank = dist.get_rank()
        rows = [dist.new_group([i * s + j for j in range(s)]) for i in range(r)]
        cols = [dist.new_group([i * s + j for i in range(r)]) for j in range(s)]
        return rows[rank // s], cols[rank % s]

    return cached_layout(("pg", r, s), make)


def digest(t: torch.Tensor | None) -> str:
    if t is None:
        return "none"
    t = t.detach()
    if is_sharded(t):
        t = t.to_local()
    raw = t.reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return f"{tuple(t.shape)}:{hashlib.sha1(raw).hexdigest()[:16]}"


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bitwise-equal values of one shape, NaN equal to NaN (a diverged model's
    values are carried and compared like any others)."""
    return a is not None and b is not None and a.shape == b.shape and bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))


# ---- wrapping -----------------------------------------------------------------------


def _shard2(spec: CaseSpec, built, mesh) -> nn.Module:
    fully_shard, _, _ = fsdp2_api()
    for grp in shard_order(spec.plan, graph_of(spec)):
        kwargs = {"mesh": mesh}
        if grp.reshard_after_forward is not None:
            kwargs["reshard_after_forward"] = grp.reshard_after_forward
        mods = [built.modules[p] for p in grp.modules]
        fully_shard(mods if len(mods) > 1 else mods[0], **kwargs)
    return built.model


def wrap_hsdp(spec: CaseSpec, built, **fsdp1_kwargs) -> nn.Module:
    h = spec.hsdp
    if h.way == "fsdp2-mesh":
        return _shard2(spec, built, hsdp_mesh(h.mesh))
    strategy = ShardingStrategy[h.strategy]
    if h.way == "fsdp1-mesh":
        return a1.wrap(spec, built, sharding_strategy=strategy, device_mesh=hsdp_mesh(h.mesh), **fsdp1_kwargs)
    return a1.wrap(spec, built, sharding_strategy=strategy, process_group=process_group_pair(h.mesh), **fsdp1_kwargs)


def wrap_flat(spec: CaseSpec, built) -> nn.Module:
    """The same case as FSDP over the whole world (a 1-D mesh; FSDP1's flat
    counterpart of the hybrid strategy)."""
    if spec.hsdp.way == "fsdp2-mesh":
        return _shard2(spec, built, fsdp2_mesh())
    return a1.wrap(spec, built, sharding_strategy=ShardingStrategy[FLAT_STRATEGY[spec.hsdp.strategy]])


# ---- what a rank holds ----------------------------------------------------------------


def local_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as this rank holds it (a DTensor's local shard, an
    FSDP1 flat parameter or view), by its name in the wrapped model: a copy
    (the optimizer updates the shards in place)."""
    return {a1.clean(n): local_part(p.detach()).clone() for n, p in model.named_parameters()}


def layout(spec: CaseSpec, model: nn.Module, aliases) -> tuple[LocalSeen, ...]:
    """FSDP2: each parameter's placements, mesh, local and full shape;
    FSDP1: each unit's flat parameter (named unit:<path>), local numel and
    its unsharded numel."""
    out = []
    if spec.plan.api == "fsdp2":
        for n, p in model.named_parameters():
            if is_sharded(p):
                out.append(LocalSeen(n, str(tuple(p.placements)), tuple(p.to_local().shape), tuple(p.shape), tuple(p.device_mesh.shape)))
            else:
                out.append(LocalSeen(n, "", tuple(p.shape), tuple(p.shape)))
        return tuple(out)
    for u in FSDP.fsdp_modules(model):
        handle = getattr(u, "_handle", None)
        if handle is None:
            continue
        fp = handle.flat_param
        path = aliases.canon_of_module.get(id(u.module), "?")
        full = tuple(getattr(fp, "_unpadded_unsharded_size", fp.shape))
        out.append(LocalSeen(f"unit:{path}", "", (int(fp._local_shard.numel()) if hasattr(fp, "_local_shard") else fp.numel(),), full))
    return tuple(sorted(out, key=lambda x: x.name))


def final_values(spec: CaseSpec, model: nn.Module, inner: nn.Module, aliases) -> dict[str, torch.Tensor]:
    """{FQN: full value} for every alias (collective: every rank calls it)."""
    names = list(aliases.param_canon)
    if spec.plan.api == "fsdp1":
        with FSDP.summon_full_params(model, writeback=False):
            return {f: read_attr(model, f).detach().clone() for f in names}
    return {f: full_tensor(read_attr(inner, f).detach()) for f in names}


# ---- training -------------------------------------------------------------------------


def _batch(x0: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    """Different on every rank, so on every replica: a replica whose
    gradient misses the replicate all-reduce then differs from the others."""
    return x0 * (1.0 + 0.25 * step) * (1.0 + 0.5 * rank)


def train(spec: CaseSpec, model: nn.Module, x0: torch.Tensor, rec: Recorder | None = None) -> tuple[list[float], list[StepSeen]]:
    h = spec.hsdp
    rank = dist.get_rank()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(h.optimizer, trainable, h.lr) if trainable else None
    losses, steps = [], []
    for k in range(h.steps):
        x = _batch(x0, k, rank)
        if rec is not None:
            rec.phase = "forward"
            with rec.mode:
                out = model(x)
        else:
            out = model(x)
        loss = (out.float() ** 2).sum()
        if loss.requires_grad:
            if rec is not None:
                rec.phase = "backward"
                with rec.mode:
                    loss.backward()
            else:
                loss.backward()
        grads = tuple((n, digest(p.grad)) for n, p in model.named_parameters())
        if opt is not None:
            opt.step()
        params = tuple((a1.clean(n), digest(p)) for n, p in model.named_parameters())
        buffers = tuple((a1.clean(n), digest(b)) for n, b in model.named_buffers())
        seen = rec.take(loss.requires_grad).collectives if rec is not None else ()
        steps.append(StepSeen(tuple((a1.clean(n), d) for n, d in grads), params, buffers, seen))
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, steps


def train_reference(spec: CaseSpec, model: nn.Module, x0: torch.Tensor) -> tuple[list[float], list[float]]:
    """Single-process training on the mean loss over every rank's batch (the
    gradient data-parallel averaging gives): this rank's batch's losses, and
    the mean losses (the same on every rank)."""
    h = spec.hsdp
    rank, world = dist.get_rank(), dist.get_world_size()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(h.optimizer, trainable, h.lr) if trainable else None
    losses, totals = [], []
    for k in range(h.steps):
        total, per_rank = reference_loss(model, [_batch(x0, k, r) for r in range(world)])
        if opt is not None:
            total.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(per_rank[rank].detach()))
        totals.append(float(total.detach()))
    return losses, totals


def _compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], floor: dict[str, torch.Tensor]) -> tuple[ValueSeen, ...]:
    """Each value against ``want`` within the training tolerance and the
    reference's noise ``floor`` (its fp32 run's distance from fp64)."""
    out = []
    for f, v in got.items():
        w = want[f].detach()
        close = train_close(v, w, floor.get(f, 0.0))
        diff = float((v - w).abs().max()) if v.shape == w.shape and v.numel() else 0.0
        out.append(ValueSeen(f, close, diff))
    return tuple(out)


# ---- state dicts ----------------------------------------------------------------------


def _sd_differs(model_from: nn.Module, model_to: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Load ``model_from``'s full state dict into ``model_to`` and take it
    back: (its keys, the keys whose values did not come back equal)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    opts = StateDictOptions(full_state_dict=True)
    sd = {k: full_tensor(v).detach().clone() for k, v in get_model_state_dict(model_from, options=opts).items()}
    # a copy: set_model_state_dict replaces the given dict's values by the model's DTensors
    set_model_state_dict(model_to, {k: v.clone() for k, v in sd.items()}, options=opts)
    back = {k: full_tensor(v) for k, v in get_model_state_dict(model_to, options=opts).items()}
    differs = tuple(sorted(k for k in set(sd) | set(back) if not same(sd.get(k), back.get(k))))
    return tuple(sorted(sd)), differs


def _dcp_differs(model_from: nn.Module, model_to: nn.Module) -> tuple[str, ...]:
    """Save ``model_from``'s sharded state dict with torch.distributed.checkpoint,
    load it into ``model_to``: the keys whose full values differ from
    ``model_from``'s. The directory is rank 0's, removed after the load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    where = [scratch_dir(DCP_PREFIX) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    try:
        dcp.save(get_model_state_dict(model_from), checkpoint_id=where[0])
        sd = get_model_state_dict(model_to)
        dcp.load(sd, checkpoint_id=where[0])
        set_model_state_dict(model_to, sd)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(where[0], ignore_errors=True)
    opts = StateDictOptions(full_state_dict=True)
    want = {k: full_tensor(v) for k, v in get_model_state_dict(model_from, options=opts).items()}
    got = {k: full_tensor(v) for k, v in get_model_state_dict(model_to, options=opts).items()}
    return tuple(sorted(k for k in set(want) | set(got) if not same(want.get(k), got.get(k))))


# ---- sync from rank 0 -----------------------------------------------------------------

# Buffers the sync adds to every module of the case (the drawn trees hold
# few): one the state dict carries, one it does not; built from each rank's
# own seed. Below the root too: FSDP1 syncs a unit's buffers with
# module.buffers(), its non-unit submodules' included.
SYNC_BUFFERS = (("hsdp_sync_persistent", True), ("hsdp_sync_non_persistent", False))
SYNC_SALT = 7_919


def _rank_seeded(spec: CaseSpec, seed: int):
    built = placed(build(dataclasses.replace(spec, seed=seed)))
    add_rank_buffers(built, seed, SYNC_BUFFERS, SYNC_SALT)
    return built


def sync_from_rank0(spec: CaseSpec) -> tuple[str | None, tuple[str, ...], tuple[str, ...]]:
    """Every rank builds the case from its own seed (spec.seed + rank), then
    the HSDP layout makes it rank 0's: FSDP2 by set_model_state_dict(rank 0's
    full state dict, broadcast_from_rank0=True) on the 2-D mesh, FSDP1 by
    sync_module_states=True. Returns (the error, the names compared, those
    whose full value here differs from rank 0's): every parameter and
    persistent buffer; FSDP1's non-persistent buffers too (its docstring:
    "module parameters and buffers"), not FSDP2's (outside a state dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank = dist.get_rank()
    want = _rank_seeded(spec, spec.seed)  # rank 0's model, which every rank can build (and keeps unwrapped)
    own = _rank_seeded(spec, spec.seed + rank)
    aliases = a1.Aliases(own.model)
    fsdp1 = spec.plan.api == "fsdp1"
    error = None
    try:
        if fsdp1:
            model = wrap_hsdp(spec, own, sync_module_states=True)
        else:
            rank0_sd = {k: v.detach().clone() for k, v in want.model.state_dict().items()}
            model = wrap_hsdp(spec, own)
            set_model_state_dict(model, rank0_sd if rank == 0 else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    except Exception as e:  # noqa: BLE001 - FSDP's failure is the observation
        error = error_line(e) + load_cause(e)
    if any_rank_failed(error is not None):
        return error or "another rank's sync raised", (), ()
    try:  # the synced model's full values: FSDP's work too (FSDP1: summon_full_params)
        got = final_values(spec, model, own.model, aliases)
    except Exception as e:  # noqa: BLE001
        error = f"full values: {error_line(e)}"
    if any_rank_failed(error is not None):
        return error or "another rank's read of the synced values raised", (), ()
    ref = dict(want.model.named_parameters(remove_duplicate=False))
    differs = [f for f, v in got.items() if not same(v, ref[f].detach())]
    checked = list(got)
    persistent = set(want.model.state_dict())
    ref_bufs = {f: m._buffers[n] for f, m, n in case_buffers(want)}
    for f, m, n in case_buffers(own):  # by the spec's paths: FSDP1's wrapped names would match none
        if f in ref_bufs and (fsdp1 or f in persistent):
            checked.append(f)
            if not same(m._buffers[n].detach(), ref_bufs[f].detach()):
                differs.append(f)
    return None, tuple(sorted(checked)), tuple(sorted(differs))


# ---- one observation ------------------------------------------------------------------


def observe(spec: CaseSpec) -> HsdpObservation:
    h = spec.hsdp
    rank, world = dist.get_rank(), dist.get_world_size()
    base = dict(api=spec.plan.api, rank=rank, world_size=world, backend=str(dist.get_backend()), torch_version=torch.__version__,
                mesh=tuple(h.mesh))
    t0 = time.perf_counter()
    # FSDP's time: wrapping, training, reading the full values, flat FSDP,
    # the sync from rank 0 and the state dicts, not the builds, the
    # single-process reference or the comparisons
    fsdp = Stopwatch()
    obs: dict = dict(base)

    def finish(**kw) -> HsdpObservation:
        return HsdpObservation(**{**obs, **kw}, fsdp_seconds=fsdp.seconds, seconds=time.perf_counter() - t0)

    if h.world != world:
        return finish(wrap_error=f"the case's mesh {h.mesh} needs {h.world} ranks, this world has {world}")
    fake = base["backend"] == "fake"
    built = placed(build(spec))
    aliases = a1.Aliases(built.model)
    unsharded_keys = tuple(sorted(built.model.state_dict()))
    error = None
    with fsdp.timing():
        try:
            model = wrap_hsdp(spec, built)
        except Exception as e:  # noqa: BLE001 - FSDP's rejection is the observation
            error = error_line(e)
    if any_rank_failed(error is not None):
        return finish(wrap_error=error or "another rank's wrapping raised")
    with fsdp.timing():
        shape0 = layout(spec, model, aliases)
        initial_local = local_tensors(model)
    obs["layout"] = shape0
    rec = Recorder()
    error = None
    with fsdp.timing():
        try:
            losses, steps = train(spec, model, built.example_input(), rec)
        except Exception as e:  # noqa: BLE001
            error = error_line(e)
    if any_rank_failed(error is not None):
        return finish(step_error=error or "another rank's training raised")
    obs.update(steps=tuple(steps), losses=tuple(losses))
    if fake:  # the fake group's collectives carry no data: structure and collectives only
        return finish()

    # reading the trained model's full values is FSDP's work too (FSDP1:
    # summon_full_params unshards each unit): a raise there is the training's
    error = None
    with fsdp.timing():
        try:
            final = final_values(spec, model, built.model, aliases)
        except Exception as e:  # noqa: BLE001
            error = error_line(e)
    if any_rank_failed(error is not None):
        return finish(step_error=error or "another rank's read of the trained values raised")
    ref = placed(build(spec))
    ref_losses, ref_totals = train_reference(spec, ref.model, ref.example_input())
    refs = dict(ref.model.named_parameters(remove_duplicate=False))
    floor, loss_floor = reference_noise(spec, train_reference, lambda m: dict(m.named_parameters(remove_duplicate=False)), refs, ref_losses)
    obs.update(ref_losses=tuple(ref_losses), ref_stable=stable(ref_totals, ref.model),
               losses_close=train_close(torch.tensor(losses), torch.tensor(ref_losses), loss_floor),
               vs_reference=_compare(final, refs, floor))

    # flat FSDP over the whole world, trained alike
    flat_built = placed(build(spec))
    flat_aliases = a1.Aliases(flat_built.model)
    error = None
    with fsdp.timing():
        try:
            flat = wrap_flat(spec, flat_built)
            flat_layout = layout(spec, flat, flat_aliases)
            flat_initial = local_tensors(flat)
            train(spec, flat, flat_built.example_input())
            flat_final = final_values(spec, flat, flat_built.model, flat_aliases)
        except Exception as e:  # noqa: BLE001
            error = error_line(e)
    if any_rank_failed(error is not None):
        return finish(flat_error=error or "another rank's flat FSDP raised")
    now_local = local_tensors(model)
    flat_now = local_tensors(flat)
    # a local shard (FSDP1: a flat parameter) mixes names: the worst noise of any
    worst = max((float(t.max()) for t in floor.values() if t.numel()), default=0.0)
    same_init, close_final = [], []
    for n, t in initial_local.items():
        f = flat_initial.get(n)
        same_init.append((n, same(f, t)))
        g, fn = now_local.get(n), flat_now.get(n)
        if g is None:  # FSDP1 with use_orig_params=True may stop listing a view (its sharded views change with the state)
            continue
        close_final.append((n, fn is not None and fn.shape == g.shape and train_close(g, fn, worst)))
    obs.update(vs_flat=_compare(final, flat_final, floor), flat_layout=flat_layout, flat_initial_equal=tuple(same_init),
               flat_final_close=tuple(close_final))

    with fsdp.timing():
        obs["sync_error"], obs["sync_checked"], obs["sync_differs"] = sync_from_rank0(spec)
    if not unsharded_keys:  # nothing to save: DCP rejects an empty model state dict
        return finish()
    # full state dicts both ways: HSDP's into a fresh flat FSDP, flat FSDP's into a fresh HSDP
    error = None
    with fsdp.timing():
        try:
            fresh_flat = wrap_flat(spec, placed(build(spec)))
            keys, to_flat = _sd_differs(model, fresh_flat)
            fresh_hsdp = wrap_hsdp(spec, placed(build(spec)))
            _, from_flat = _sd_differs(flat, fresh_hsdp)
            dcp_to_flat = _dcp_differs(model, wrap_flat(spec, placed(build(spec))))
        except Exception as e:  # noqa: BLE001
            error = error_line(e)
    if any_rank_failed(error is not None):
        return finish(sd_error=error or "another rank's state dict raised")
    return finish(sd_keys=keys, unsharded_keys=unsharded_keys, sd_to_flat_differs=to_flat, sd_from_flat_differs=from_flat,
                  dcp_to_flat_differs=dcp_to_flat)
