"""Tensor parallelism + FSDP2 adapter: parallelize a built case over the "tp"
dim of a (dp, tp) DeviceMesh (parallelize_module with the plan's styles),
fully_shard it over mesh["dp"], and record what each rank holds (layout,
full tensors), what a few optimizer steps on data that differs by dp rank
give against single-process training, what mixed precision casts, what
clip_grad_norm_ returns over the 2-D gradients, and full and sharded state
dicts carried to flat FSDP (no TP, 1-D over the world) and back. The only
module of the area that calls torch.distributed and FSDP."""

from __future__ import annotations

import math
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.areas.common import fsdp1_adapter as a1
from conformance.areas.common.clipping import norm_agrees, reference_norm
from conformance.areas.common.fsdp2_adapter import error_line, fsdp2_api, full_tensor
from conformance.areas.common.fsdp2_oracle import shard_order
from conformance.areas.common.ranks import any_rank_failed, failed_ranks
from conformance.areas.common.support import fsdp2_mesh, placed, rank_device
from conformance.areas.common.timing import Stopwatch
from conformance.areas.common.training import NOISE_FACTOR, TRAIN_ATOL, TRAIN_RTOL, make_optimizer, reference_loss, reference_noise, stable
from conformance.areas.tp.observation import LayoutSeen, TpObservation, ValueSeen
from conformance.areas.tp.oracle import predict_tp
from conformance.case.build import build, is_sharded
from conformance.case.spec import CaseSpec
from conformance.case.target import graph_of
from conformance.paths import scratch_dir

MESH_DIMS = ("dp", "tp")
DCP_PREFIX = "fsdp-conformance-tp-"
# one backward and one clip against one process (as the clip area's)
CLIP_RTOL, CLIP_ATOL = 1e-4, 1e-5

_MESHES: dict = {}


def tp_mesh(shape: tuple[int, int]):
    """The (dp, tp) mesh, made once per default group and shape (making it is
    collective), by every rank alike."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (id(dist.distributed_c10d._get_default_group()), tuple(shape))
    if key not in _MESHES:
        _MESHES.clear()
        _MESHES[key] = init_device_mesh(rank_device().type, tuple(shape), mesh_dim_names=MESH_DIMS)
    return _MESHES[key]


def flat_mesh():
    key = (id(dist.distributed_c10d._get_default_group()), "flat")
    if key not in _MESHES:
        _MESHES[key] = fsdp2_mesh()
    return _MESHES[key]


# ---- wrapping -----------------------------------------------------------------------


def style(kind: str, paired: bool = False):
    """The ParallelStyle of a plan's style name, each keeping the leaf's inputs
    and outputs plain, replicated tensors (conformance.case.spec.TP_STYLES);
    a leaf of a pair (TpPlan.pairs) takes the style's defaults: colwise
    output Shard(-1) into rowwise input Shard(-1), the hidden activation
    never gathered."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if kind == "colwise":
        return ColwiseParallel() if paired else ColwiseParallel(output_layouts=Replicate())
    if kind == "rowwise":
        return RowwiseParallel() if paired else RowwiseParallel(input_layouts=Replicate())
    return SequenceParallel(sequence_dim=0)


def parallelize(spec: CaseSpec, built, mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module

    tp = mesh["tp"]
    paired = {p for pair in spec.tp.pairs for p in pair}
    for path, kind in spec.tp.styles:
        if kind == "sequence":
            # the replicated activation enters as a Replicate DTensor (SequenceParallel
            # shards it on the sequence dim, a local slice), its output is gathered back
            parallelize_module(built.model, tp, {path: PrepareModuleInputOutput(
                input_layouts=Replicate(), desired_input_layouts=Replicate(),
                output_layouts=Shard(0), desired_output_layouts=Replicate(), use_local_output=True)})
        parallelize_module(built.model, tp, {path: style(kind, path in paired)})


def mp_policy(precision: str):
    if precision == "none":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32 if precision == "bf16-fp32-reduce" else None)


def shard(spec: CaseSpec, built, mesh) -> nn.Module:
    """fully_shard bottom-up over ``mesh`` (the dp mesh, or the flat one), the plan's groups and the root."""
    fully_shard, _, _ = fsdp2_api()
    policy = mp_policy(spec.tp.precision)
    for grp in shard_order(spec.plan, graph_of(spec)):
        kwargs = {"mesh": mesh}
        if grp.reshard_after_forward is not None:
            kwargs["reshard_after_forward"] = grp.reshard_after_forward
        if policy is not None:
            kwargs["mp_policy"] = policy
        mods = [built.modules[p] for p in grp.modules]
        fully_shard(mods if len(mods) > 1 else mods[0], **kwargs)
    return built.model


def wrap_2d(spec: CaseSpec, built) -> nn.Module:
    mesh = tp_mesh(spec.tp.mesh)
    parallelize(spec, built, mesh)
    return shard(spec, built, mesh["dp"])


def wrap_flat(spec: CaseSpec, built) -> nn.Module:
    """The same case as FSDP2 over the whole world, no TP (1-D mesh)."""
    return shard(spec, built, flat_mesh())


# ---- what a rank holds ----------------------------------------------------------------


def expected_local(full: torch.Tensor, tp_placement: str, mesh: tuple[int, int], rank: int) -> torch.Tensor:
    """The oracle's local shard of ``full`` on ``rank``: torch.chunk's TP piece,
    then its dp piece of dim 0."""
    dp, tp = mesh
    d, t = rank // tp, rank % tp
    x = full
    if tp_placement.startswith("Shard(dim="):
        dim = int(tp_placement[len("Shard(dim="):-1])
        x = _piece(x, dim, tp, t)
    return _piece(x, 0, dp, d)


def _piece(x: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    pieces = torch.chunk(x, parts, dim=dim) if x.shape[dim] else ()
    if index < len(pieces):
        return pieces[index]
    shape = list(x.shape)
    shape[dim] = 0
    return x.new_empty(shape)


def layout(spec: CaseSpec, model: nn.Module, aliases, unsharded: dict[str, torch.Tensor], values: bool) -> tuple[LayoutSeen, ...]:
    pred = predict_tp(spec).by_fqn()
    rank = dist.get_rank()
    out = []
    for n, p in model.named_parameters():
        fqn = aliases.param_canon.get(n, n)
        if not is_sharded(p):
            out.append(LayoutSeen(fqn, "", (), tuple(p.shape)))
            continue
        local = p.to_local()
        equal = None
        if values and fqn in pred and fqn in unsharded:
            want = expected_local(unsharded[fqn], pred[fqn].tp, spec.tp.mesh, rank)
            equal = want.shape == local.shape and bool(torch.equal(want, local.detach()))
        out.append(LayoutSeen(fqn, str(tuple(p.placements)), tuple(p.device_mesh.shape), tuple(local.shape), equal))
    return tuple(sorted(out, key=lambda x: x.fqn))


def tp_empty(model: nn.Module, aliases) -> tuple[str, ...]:
    """Parameters whose TP-local tensor (what fully_shard shards further) is
    empty on this rank, while the parameter is not."""
    out = []
    for n, p in model.named_parameters():
        if is_sharded(p) and p.numel() and p.device_mesh.ndim == 2:
            if any(s == 0 for s in _tp_local_shape(p)):
                out.append(aliases.param_canon.get(n, n))
    return tuple(sorted(out))


def _tp_local_shape(p) -> tuple[int, ...]:
    """The TP-local shape of a 2-D parameter: its full shape less the tp dim's shard."""
    shape = list(p.shape)
    tp = p.device_mesh.shape[1]
    t = p.device_mesh.get_local_rank(1)
    pl = p.placements[1]
    if hasattr(pl, "dim") and type(pl).__name__ == "Shard":
        shape[pl.dim] = _chunk_size(shape[pl.dim], tp, t)
    return tuple(shape)


def _chunk_size(n: int, parts: int, index: int) -> int:
    size = -(-n // parts) if n else 0
    return max(0, min(size, n - index * size))


def reshard_all(model: nn.Module) -> None:
    """Every FSDP2 module resharded (FSDPModule.reshard): a forward with no
    backward after it (every parameter frozen) leaves the root's unsharded
    parameters registered where reshard_after_forward is False."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def requires_grad_changed(model: nn.Module, aliases, before: dict[str, bool]) -> tuple[str, ...]:
    """Parameters whose requires_grad after parallelize_module and fully_shard
    is not the unsharded model's."""
    return tuple(sorted(f for n, p in model.named_parameters() if before.get(f := aliases.param_canon.get(n, n), p.requires_grad) != p.requires_grad))


def full_values(model: nn.Module, aliases) -> dict[str, torch.Tensor]:
    """{canonical FQN: full value} (collective: every rank calls it)."""
    return {aliases.param_canon.get(n, n): full_tensor(p.detach()).clone() for n, p in model.named_parameters()}


# ---- training -------------------------------------------------------------------------


def batch(x0: torch.Tensor, step: int, dp_index: int) -> torch.Tensor:
    """Different on every dp rank, the same on a dp rank's tp ranks (TP's
    ranks compute one batch together): a gradient that misses the dp
    reduction then differs from the reference's."""
    return x0 * (1.0 + 0.25 * step) * (1.0 + 0.5 * dp_index)


def _record_dtypes(model: nn.Module, aliases, seen: dict[str, str]):
    """Forward pre-hooks on every module with parameters of its own: the dtype
    of each one's local tensor when its forward starts."""
    handles = []
    for path, m in model.named_modules():
        own = list(m.named_parameters(recurse=False))
        if not own:
            continue

        def hook(mod, args, path=path):
            for name, p in mod.named_parameters(recurse=False):
                t = p.to_local() if is_sharded(p) else p
                seen.setdefault(aliases.param_canon.get(f"{path}.{name}" if path else name, name), str(t.dtype))

        handles.append(m.register_forward_pre_hook(hook))
    return handles


def train(spec: CaseSpec, model: nn.Module, x0: torch.Tensor, aliases, dtypes: dict | None = None) -> list[float]:
    t = spec.tp
    d = dist.get_rank() // t.mesh[1]
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(t.optimizer, trainable, t.lr) if trainable else None
    losses = []
    for k in range(t.steps):
        handles = _record_dtypes(model, aliases, dtypes) if dtypes is not None and k == 0 else []
        try:
            loss = (model(batch(x0, k, d)).float() ** 2).sum()
        finally:
            for h in handles:
                h.remove()
        if loss.requires_grad:
            loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    reshard_all(model)
    return losses


def train_reference(spec: CaseSpec, model: nn.Module, x0: torch.Tensor) -> tuple[list[float], list[float]]:
    """Single-process training on the mean loss over every dp rank's batch:
    this rank's batch's losses, and the mean losses."""
    t = spec.tp
    dp = t.mesh[0]
    d = dist.get_rank() // t.mesh[1]
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(t.optimizer, trainable, t.lr) if trainable else None
    losses, totals = [], []
    for k in range(t.steps):
        total, per = reference_loss(model, [batch(x0, k, i) for i in range(dp)])
        if opt is not None:
            total.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(per[d].detach()))
        totals.append(float(total.detach()))
    return losses, totals


def _compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float, atol: float,
             floor: dict[str, torch.Tensor] | None = None) -> tuple[ValueSeen, ...]:
    """Each value against ``want`` within rtol and atol (scaled by the
    largest value), plus NOISE_FACTOR times the reference's noise ``floor``
    (its float32 run's distance from float64), where given."""
    out = []
    for f, v in sorted(got.items()):
        w = want[f].detach()
        scale = float(w.abs().max()) if w.numel() else 0.0
        close = v.shape == w.shape and bool(torch.allclose(v.float(), w.float(), rtol=rtol, atol=atol * max(1.0, scale)))
        if not close and floor is not None and f in floor and v.shape == w.shape:
            bound = atol * max(1.0, scale) + rtol * w.float().abs() + NOISE_FACTOR * floor[f]
            close = bool(((v.float() - w.float()).abs() <= bound).all())
        diff = float((v.float() - w.float()).abs().max()) if v.shape == w.shape and v.numel() else 0.0
        out.append(ValueSeen(f, close, diff))
    return tuple(out)


# ---- clipping -------------------------------------------------------------------------


def _local_probe(grads: list[torch.Tensor], norm_type: float, foreach: bool) -> bool:
    """Whether the rank-local part of the norm raises here (no collective): a
    rank whose clip raises before its reduction leaves the others waiting in it."""
    local = [g.to_local() if is_sharded(g) else g for g in grads]
    try:
        torch.nn.utils.get_total_norm(local, norm_type, foreach=foreach)
    except Exception:  # noqa: BLE001 - any error: the real call raises where it runs
        return True
    return False


def clip(spec: CaseSpec, model: nn.Module, ref: nn.Module, aliases, ref_aliases, x0: torch.Tensor) -> dict:
    """One more backward on FSDP's and the reference's model, then
    clip_grad_norm_ over the plan's parameters to half the reference norm."""
    t = spec.tp
    pred = predict_tp(spec)
    norm_type = float(t.norm_type)
    clipped = set(pred.clipped)
    dp = t.mesh[0]
    d = dist.get_rank() // t.mesh[1]
    total, _ = reference_loss(ref, [batch(x0, t.steps, i) for i in range(dp)])
    ref_params = {ref_aliases.param_canon.get(n, n): p for n, p in ref.named_parameters()}
    if total.requires_grad:
        total.backward()
    ref_grads = [ref_params[f].grad for f in sorted(clipped) if ref_params[f].grad is not None]
    ref_norm = reference_norm(ref_grads, norm_type)
    max_norm = 0.5 * ref_norm
    coef = min(1.0, max_norm / (ref_norm + 1e-6))
    out: dict = {"ref_norm": ref_norm}
    loss = (model(batch(x0, t.steps, d)).float() ** 2).sum()
    if loss.requires_grad:
        loss.backward()
    reshard_all(model)
    params = [p for n, p in model.named_parameters() if aliases.param_canon.get(n, n) in clipped]
    grads = [p.grad for p in params if p.grad is not None]
    out["clip_meshes"] = tuple(sorted({tuple(g.device_mesh.shape) if is_sharded(g) else () for g in grads}))
    probe_failed = _local_probe(grads, norm_type, t.foreach)
    n = failed_ranks(probe_failed)
    call = probe_failed or not 0 < n < dist.get_world_size()
    error, norm = None, None
    if call:
        try:
            if t.clip_way == "get_total_norm":
                tn = torch.nn.utils.get_total_norm(grads, norm_type, foreach=t.foreach)
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, tn, foreach=t.foreach)
            else:
                tn = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, foreach=t.foreach)
            norm = float(full_tensor(tn.detach()))
        except Exception as e:  # noqa: BLE001
            error = error_line(e)
    failed = failed_ranks(error is not None or not call) > 0
    out.update(clip_error=error, clip_peer_failed=not call, clip_failed=failed, norm=norm)
    if norm is not None:
        out["norm_close"] = norm_agrees(norm, ref_norm, CLIP_RTOL, CLIP_ATOL)
    if failed:
        return out
    # max_norm / an overflowed norm is inf / inf: nothing to compare the clipped gradients with
    out["scale_finite"] = math.isfinite(ref_norm)
    got = {aliases.param_canon.get(n, n): full_tensor(p.grad.detach()).clone() for n, p in model.named_parameters()
           if aliases.param_canon.get(n, n) in clipped and p.grad is not None}
    want = {f: ref_params[f].grad * coef for f in got}
    out["clipped_grads"] = _compare(got, want, CLIP_RTOL, CLIP_ATOL)
    return out


# ---- state dicts ----------------------------------------------------------------------


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype and bool(
        torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))


def full_sd(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: full_tensor(v).detach().clone() for k, v in sd.items()}


def sd_differs(model_from: nn.Module, model_to: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Load ``model_from``'s full state dict into ``model_to`` and take it
    back: (its keys, the keys whose values did not come back equal)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    sd = full_sd(model_from)
    set_model_state_dict(model_to, {k: v.clone() for k, v in sd.items()}, options=StateDictOptions(full_state_dict=True))
    back = full_sd(model_to)
    return tuple(sorted(sd)), tuple(sorted(k for k in set(sd) | set(back) if not same(sd.get(k), back.get(k))))


def dcp_differs(model_from: nn.Module, model_to: nn.Module) -> tuple[str, ...]:
    """Save ``model_from``'s sharded state dict with torch.distributed.checkpoint
    into a directory of rank 0's, load it into ``model_to``: the keys whose
    full values differ."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

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
    want, got = full_sd(model_from), full_sd(model_to)
    return tuple(sorted(k for k in set(want) | set(got) if not same(want.get(k), got.get(k))))


def error_text(e: BaseException) -> str:
    """The error, its whole message on one line (load_state_dict's first line
    names only the model; the cause follows)."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"


# ---- one observation ------------------------------------------------------------------


def observe(spec: CaseSpec) -> TpObservation:
    t = spec.tp
    rank, world = dist.get_rank(), dist.get_world_size()
    base = dict(api="fsdp2", rank=rank, world_size=world, backend=str(dist.get_backend()), torch_version=torch.__version__, mesh=tuple(t.mesh))
    t0 = time.perf_counter()
    # FSDP's (and DTensor's) time: parallelize_module and fully_shard, reading
    # the layout and the full values, training, clipping, the state dicts;
    # not the builds, the single-process reference or the comparisons
    fsdp = Stopwatch()
    obs: dict = dict(base)

    def finish(**kw) -> TpObservation:
        return TpObservation(**{**obs, **kw}, seconds=time.perf_counter() - t0, fsdp_seconds=fsdp.seconds)

    if t.world != world:
        return finish(wrap_error=f"the case's mesh {t.mesh} needs {t.world} ranks, this world has {world}")
    fake = base["backend"] == "fake"
    built, ref = placed(build(spec)), placed(build(spec))
    aliases, ref_aliases = a1.Aliases(built.model), a1.Aliases(ref.model)
    unsharded = {ref_aliases.param_canon.get(n, n): p.detach().clone() for n, p in ref.model.named_parameters()}
    unsharded_keys = tuple(sorted(ref.model.state_dict()))
    error = None
    with fsdp.timing():
        try:
            model = wrap_2d(spec, built)
        except Exception as e:  # noqa: BLE001
            error = error_line(e)
    if any_rank_failed(error is not None):
        return finish(wrap_error=error or "another rank's wrapping raised")
    frozen_before = {ref_aliases.param_canon.get(n, n): p.requires_grad for n, p in ref.model.named_parameters()}
    with fsdp.timing():
        obs.update(layout=layout(spec, model, aliases, unsharded, not fake), tp_empty=tp_empty(model, aliases),
                   requires_grad_changed=requires_grad_changed(model, aliases, frozen_before))
    if fake:  # structure only: the fake tier's collectives carry no data
        return finish()
    # the wrapped model's full values (DTensor.full_tensor's collectives): FSDP's and DTensor's work, not the suite's
    error = None
    with fsdp.timing():
        try:
            now = full_values(model, aliases)
        except Exception as e:  # noqa: BLE001
            error = f"full values: {error_line(e)}"
    if any_rank_failed(error is not None):
        return finish(wrap_error=error or "another rank's read of the full values raised")
    obs["full_equal"] = tuple((f, same(v, unsharded.get(f))) for f, v in sorted(now.items()))

    dtypes: dict[str, str] = {}
    error = None
    with fsdp.timing():
        try:
            losses = train(spec, model, built.example_input(), aliases, dtypes if t.precision != "none" else None)
        except Exception as e:  # noqa: BLE001
            error = error_line(e)
    if t.precision != "none":  # what forward saw, also where training then raised
        obs["forward_dtypes"] = tuple(sorted(dtypes.items()))
    if any_rank_failed(error is not None):
        return finish(step_error=error or "another rank's training raised")
    obs["losses"] = tuple(losses)
    if t.precision != "none":
        obs["sharded_dtypes"] = tuple(sorted((aliases.param_canon.get(n, n), str(p.dtype)) for n, p in model.named_parameters()))
    with fsdp.timing():
        try:
            final = full_values(model, aliases)
        except Exception as e:  # noqa: BLE001
            error = f"full values: {error_line(e)}"
    if any_rank_failed(error is not None):
        return finish(step_error=error or "another rank's read of the trained values raised")
    ref_losses, ref_totals = train_reference(spec, ref.model, ref.example_input())
    refs = {ref_aliases.param_canon.get(n, n): p for n, p in ref.model.named_parameters()}
    vs_reference = _compare(final, refs, TRAIN_RTOL, TRAIN_ATOL)
    losses_close = bool(torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=TRAIN_RTOL, atol=TRAIN_ATOL))
    if not (losses_close and all(v.close for v in vs_reference)):
        # where the float32 reference is off, judge within its own noise (its
        # distance from the same training in float64), as PARITY and HSDP do
        def canonical(model: nn.Module) -> dict[str, torch.Tensor]:
            canon = a1.Aliases(model).param_canon
            return {canon.get(n, n): p for n, p in model.named_parameters()}

        floor, loss_floor = reference_noise(spec, train_reference, canonical, refs, ref_losses)
        vs_reference = _compare(final, refs, TRAIN_RTOL, TRAIN_ATOL, floor)
        got, want = torch.tensor(losses), torch.tensor(ref_losses)
        losses_close = bool(((got - want).abs() <= TRAIN_ATOL + TRAIN_RTOL * want.abs() + NOISE_FACTOR * loss_floor).all())
    obs.update(ref_losses=tuple(ref_losses), ref_stable=stable(ref_totals, ref.model), losses_close=losses_close,
               vs_reference=vs_reference)

    error = None
    with fsdp.timing():  # clip_grad_norm_ on the 2-D model (the reference's norm beside it: a small part)
        try:
            obs.update(clip(spec, model, ref.model, aliases, ref_aliases, built.example_input()))
        except Exception as e:  # noqa: BLE001
            error = error_line(e)
    if any_rank_failed(error is not None):
        return finish(clip_error=error or "another rank's backward before clipping raised", clip_failed=True)
    if t.precision != "none":
        obs["grad_dtypes"] = tuple(sorted((aliases.param_canon.get(n, n), str(p.grad.dtype)) for n, p in model.named_parameters()
                                          if p.grad is not None))
    if not unsharded_keys:
        return finish()
    # each round trip on its own: one that raises leaves the others compared
    done: dict = {}
    errors = []
    phases = (
        ("vs-params", lambda: tuple(sorted(k for k, v in full_sd(model).items() if k in final and not same(v, final[k])))),
        ("to-flat", lambda: sd_differs(model, wrap_flat(spec, placed(build(spec))))),
        ("from-flat", lambda: sd_differs(_trained_flat(spec, model), wrap_2d(spec, placed(build(spec))))[1]),
        ("dcp-to-flat", lambda: dcp_differs(model, wrap_flat(spec, placed(build(spec))))),
    )
    for name, run in phases:
        error = None
        with fsdp.timing():
            try:
                done[name] = run()
            except Exception as e:  # noqa: BLE001
                error = error_text(e)
        if any_rank_failed(error is not None):
            errors.append((name, error or "another rank's state dict raised"))
    keys, to_flat = done.get("to-flat", ((), ()))
    return finish(sd_errors=tuple(errors), sd_keys=keys, unsharded_keys=unsharded_keys, sd_vs_params=done.get("vs-params", ()),
                  sd_to_flat_differs=to_flat, sd_from_flat_differs=done.get("from-flat", ()),
                  dcp_to_flat_differs=done.get("dcp-to-flat", ()))


def _trained_flat(spec: CaseSpec, model: nn.Module) -> nn.Module:
    """Flat FSDP holding the trained 2-D model's values (a full state dict
    carried over), to carry back into a fresh 2-D model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    flat = wrap_flat(spec, placed(build(spec)))
    set_model_state_dict(flat, full_sd(model), options=StateDictOptions(full_state_dict=True))
    return flat
