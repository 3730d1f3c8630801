"""Microbatch adapter: fully_shard a built case (Shard(1) or CPU offload
where the plan says), run one step's microbatches with the schedule
settings drawn for each, record what FSDP2 communicates
(conformance.areas.common.comm_adapter), and compare the accumulated
gradients with the large batch's on a single-process reference. Reads
FSDP2's registered parameters through public attributes only (DTensor
placements)."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from conformance.areas.common import fsdp1_adapter as a1
from conformance.areas.common.comm_adapter import Recorder, custom_comms, fsdp2_patches, scaling_hook
from conformance.areas.common.fsdp2_adapter import error_line, fsdp2_api, full_tensors
from conformance.areas.common.fsdp2_oracle import shard_order
from conformance.areas.common.support import fsdp2_mesh, hsdp_mesh, on_rank_device, placed
from conformance.areas.common.training import rel_err
from conformance.areas.microbatch.observation import GradSeen, HookSeen, MicrobatchObservation, ShardSeen
from conformance.areas.microbatch.oracle import predict_microbatch
from conformance.case.build import BATCH, build, is_sharded, local_part, read_attr
from conformance.case.spec import CaseSpec
from conformance.case.target import graph_of


def offload_unavailable() -> str | None:
    """Why CPUOffloadPolicy cannot run here, or None: FSDP2 offloads to the
    CPU from an accelerator (on a CPU-only machine its lazy init raises
    "Cannot access accelerator device when none is available")."""
    if not torch.accelerator.is_available():
        return "CPUOffloadPolicy offloads from an accelerator; this machine has none (torch raises at lazy init)"
    return None


def api_unavailable(name: str) -> str | None:
    """Why FSDPModule.``name`` cannot be called here, or None (reset_iter_state
    and set_unshard_in_backward are in recent releases only)."""
    _, FSDPModule, _ = fsdp2_api()
    if not hasattr(FSDPModule, name):
        return f"FSDPModule.{name} is not in torch {torch.__version__}"
    return None


def data(spec: CaseSpec, micro: int, rank: int) -> torch.Tensor:
    """One rank's microbatch input: differs by rank and microbatch."""
    gen = torch.Generator().manual_seed(spec.seed * 7919 + micro * 31 + rank)
    return 0.5 * torch.randn(BATCH, generator=gen)


def _mesh(spec: CaseSpec):
    """A 1-D mesh over every rank, or the plan's (replicate, shard) one."""
    return fsdp2_mesh() if spec.microbatch.mesh is None else hsdp_mesh(spec.microbatch.mesh)


def _shard(spec: CaseSpec, built, rec: Recorder, mesh) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor import Shard

    fully_shard, _, _ = fsdp2_api()
    mb = spec.microbatch
    for grp in shard_order(spec.plan, graph_of(spec)):
        kwargs = {"mesh": mesh}
        if grp.reshard_after_forward is not None:
            kwargs["reshard_after_forward"] = grp.reshard_after_forward
        if grp.modules[0] in mb.shard_dim1:
            kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.dim() >= 2 else None
        if mb.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        mods = [built.modules[p] for p in grp.modules]
        fully_shard(mods if len(mods) > 1 else mods[0], **kwargs)
    for path in mb.no_unshard_in_backward:
        built.modules[path].set_unshard_in_backward(False)
    if mb.reduce_scatter_unused_params:
        built.model.set_reduce_scatter_unused_params(True)
    for path, scale in mb.all_reduce_hook:
        built.modules[path].set_all_reduce_hook(scaling_hook(rec, scale))
    for path in mb.custom_comms:
        all_gather, reduce_scatter = custom_comms(rec, group_label(spec, path))
        built.modules[path].set_custom_all_gather(all_gather)
        built.modules[path].set_custom_reduce_scatter(reduce_scatter)


def group_label(spec: CaseSpec, path: str) -> str:
    """The group ``path`` was given to fully_shard in, as the recorder and
    the oracle name it (its modules, ", "-joined)."""
    return ", ".join(next((g.modules for g in spec.plan.groups if path in g.modules), (path,)))


def observe(spec: CaseSpec) -> MicrobatchObservation:
    pred = predict_microbatch(spec)
    mb = spec.microbatch
    rank, world = dist.get_rank(), dist.get_world_size()
    base = dict(api="fsdp2", rank=rank, world_size=world, backend=str(dist.get_backend()), torch_version=torch.__version__)
    built, ref = placed(build(spec)), placed(build(spec))
    aliases = a1.Aliases(built.model)
    rec = Recorder()
    mesh = _mesh(spec)
    rec.shard_group = mesh.get_group() if mesh.ndim == 1 else mesh.get_group("shard")
    t0 = time.perf_counter()
    try:
        _shard(spec, built, rec, mesh)
    except Exception as e:
        return MicrobatchObservation(**base, error=f"fully_shard: {error_line(e)}", seconds=time.perf_counter() - t0)
    model = built.model
    hooked = _grad_hooks(model, pred.trainable) if mb.grad_hooks else {}
    labels = {id(m): aliases.canon_of_module.get(id(m), "?") for m in model.modules()}
    iterations, error = [], None
    with contextlib.ExitStack() as stack:
        for p in fsdp2_patches(rec, labels):
            stack.enter_context(p)
        if any(s.separate_reduce_scatter for s in mb.microbatches):
            stack.enter_context(_reused_new_groups())
        if mb.abort is not None:
            error = _abort_and_reset(spec, built, model, rank, rec)
            rec.restart()  # what the aborted iteration did is not the sequence's
            for seen in hooked.values():
                seen.update(calls=0, last=None)
        for k in range(len(mb.microbatches)) if error is None else ():
            try:
                iterations.append(rec.take(_microbatch(spec, built, model, k, rank, rec)))
            except Exception as e:
                error = f"microbatch {k}: {error_line(e)}"
                iterations.append(rec.take(True))
                break
    seconds = time.perf_counter() - t0
    shards, grads, read_error = [], [], None
    if error is None:
        # reading what FSDP left (attributes, then the gradients' full values,
        # a collective) is the observation's read_error where it raises, not
        # the scenario's own error; the ranks do not agree first: a rank that
        # raised leaves the others in full_tensor's all-gather (a HANG)
        names = list(pred.trainable) + list(pred.frozen)
        try:
            for f in names:
                p = read_attr(model, f)
                # Shard on a 1-D mesh; (Replicate, Shard) on a 2-D one
                kinds = tuple(type(pl).__name__ for pl in p.placements) if is_sharded(p) else ()
                sharded = kinds == (("Shard",) if spec.microbatch.mesh is None else ("Replicate", "Shard"))
                g = p.grad
                shards.append(ShardSeen(f, sharded, None if g is None else is_sharded(g)))
        except Exception as e:
            shards, read_error = [], f"parameters: {error_line(e)}"
        if read_error is None and base["backend"] != "fake":
            try:
                grads = _compare_grads(spec, model, ref, names, world)
            except Exception as e:
                grads, read_error = [], f"full gradients: {error_line(e)}"
    hooks = _hooks_seen(model, hooked) if error is None and read_error is None else ()
    return MicrobatchObservation(**base, error=error, iterations=tuple(iterations), grads=tuple(grads), shards=tuple(shards),
                                 hooks=hooks, read_error=read_error, seconds=seconds)


def _grad_hooks(model, trainable) -> dict[str, dict]:
    """register_post_accumulate_grad_hook on every trainable (sharded)
    parameter, as an optimizer step in backward registers it (FSDP2 runs
    them itself after writing the sharded gradient). By FQN: how often its
    hook ran and the local shard of the .grad its last call saw."""
    out: dict[str, dict] = {}
    for f in trainable:
        seen = out[f] = {"calls": 0, "last": None}

        def hook(q, seen=seen):
            seen["calls"] += 1
            seen["last"] = None if q.grad is None else local_part(q.grad).detach().clone()

        read_attr(model, f).register_post_accumulate_grad_hook(hook)
    return out


def _hooks_seen(model, hooked: dict[str, dict]) -> tuple[HookSeen, ...]:
    out = []
    for f, seen in hooked.items():
        g = read_attr(model, f).grad
        last = seen["last"]
        same = None if g is None or last is None else bool(last.shape == local_part(g).shape and torch.equal(last, local_part(g)))
        out.append(HookSeen(f, seen["calls"], g is not None, same))
    return tuple(out)


class AbortedIteration(Exception):
    """The suite's own exception, aborting an iteration (MicrobatchAbort)."""


class _RaiseInBackward(torch.autograd.Function):
    """Identity on ``x`` whose backward raises AbortedIteration; ``anchor``
    (a leaf requiring gradient) makes autograd reach it whatever is frozen."""

    @staticmethod
    def forward(ctx, x, anchor):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise AbortedIteration("backward aborted by the case")


def _microbatch(spec: CaseSpec, built, model, k: int, rank: int, rec: Recorder) -> bool:
    """Microbatch ``k``: its settings on the root, its explicit unshard, then
    forward and (where the loss needs one) backward; whether backward ran."""
    step = spec.microbatch.microbatches[k]
    model.set_requires_gradient_sync(step.sync)
    model.set_requires_all_reduce(step.all_reduce)
    model.set_reshard_after_backward(step.reshard_after_backward)
    model.set_is_last_backward(step.is_last_backward)
    if step.reshard_after_forward is not None:
        model.set_reshard_after_forward(step.reshard_after_forward)
    if step.separate_reduce_scatter is not None:
        model.set_separate_reduce_scatter_group(step.separate_reduce_scatter)
    pass_over(built, spec, step.unused_on_rank0 if rank == 0 else ())
    rec.phase = "forward"
    with rec.mode:
        if step.unshard is not None:
            target = built.modules[step.unshard]
            handle = target.unshard(async_op=step.unshard_async)
            if handle is not None:
                handle.wait()
            if step.reshard:
                target.reshard()
        out = model(on_rank_device(data(spec, k, rank)))
    loss = (out.float() ** 2).sum()
    rec.phase = "backward"
    if loss.requires_grad:
        with rec.mode:
            loss.backward()
    return loss.requires_grad


_NEW_GROUPS: list = []  # [the default group they were made in, {ranks: [groups made, in order]}]


@contextlib.contextmanager
def _reused_new_groups():
    """dist.new_group as set_separate_reduce_scatter_group calls it, the
    n-th call of an observation over a set of ranks answered with the same
    group every observation (made by the first such call): each call still
    gets a group of its own within an observation, and a rank pool running
    thousands of them holds a few groups, not thousands (a gloo group holds
    its connections; destroying them instead lets a later group take the
    destroyed one's name, hashed from the ranks and the number of live
    groups, and meet its stale rendezvous keys in the store: a hang)."""
    orig = dist.new_group
    world = dist.group.WORLD
    if not _NEW_GROUPS or _NEW_GROUPS[0] is not world:
        _NEW_GROUPS[:] = [world, {}]
    made = _NEW_GROUPS[1]
    calls: dict = {}

    def new_group(ranks=None, *args, **kwargs):
        key = (tuple(ranks) if ranks is not None else None, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])).__repr__())
        n = calls[key] = calls.get(key, -1) + 1
        groups = made.setdefault(key, [])
        if n == len(groups):
            groups.append(orig(ranks, *args, **kwargs))
        return groups[n]

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = orig


def pass_over(built, spec: CaseSpec, paths) -> None:
    """The model's forward passes over the modules ``paths`` (and runs
    every other, those the case's other microbatches pass over included)."""
    parents = {p.rpartition(".")[0] for s in spec.microbatch.microbatches for p in s.unused_on_rank0}
    for parent in parents:
        built.modules[parent].__dict__["_case_skip"] = {p.rpartition(".")[2] for p in paths if p.rpartition(".")[0] == parent}


def _abort_and_reset(spec: CaseSpec, built, model, rank: int, rec: Recorder) -> str | None:
    """MicrobatchAbort: the microbatches before the abort, the aborted one,
    reset_iter_state() on the root and every gradient set to None; the
    error (as the observation's) where FSDP raised anything but the case's
    own exception, or the aborted iteration did not raise it."""
    a = spec.microbatch.abort
    where = f"microbatch {a.before} aborted in {a.phase} at {a.at or '<root>'}"
    for k in range(a.before):
        try:
            _microbatch(spec, built, model, k, rank, rec)
        except Exception as e:
            return f"microbatch {k} (before the abort): {error_line(e)}"
    anchor = on_rank_device(torch.zeros(())).requires_grad_()

    def hook(module, args, out):
        if a.phase == "forward":
            raise AbortedIteration("forward aborted by the case")
        return _RaiseInBackward.apply(out, anchor)

    # prepend: ahead of FSDP's post-forward hook, as if the module's own forward raised
    handle = built.modules[a.at].register_forward_hook(hook, prepend=True)
    try:
        _microbatch(spec, built, model, a.before, rank, rec)
    except AbortedIteration:
        pass
    except Exception as e:
        return f"{where}: FSDP raised instead of the case's exception: {error_line(e)}"
    else:
        return f"{where}: the case's exception did not propagate"
    finally:
        handle.remove()
    try:
        model.reset_iter_state()
    except Exception as e:
        return f"{where}: reset_iter_state: {error_line(e)}"
    for p in model.parameters():
        p.grad = None
    return None


def _compare_grads(spec: CaseSpec, model, ref, names: list[str], world: int) -> list[GradSeen]:
    """Every rank's every microbatch through the single-process reference:
    loss_k = mean over ranks of (ref(x_{r,k}) ** 2).sum(), summed over k,
    rank 0's passing over the modules it does not use in microbatch k."""
    steps = spec.microbatch.microbatches
    for k in range(len(steps)):
        losses = []
        for r in range(world):
            pass_over(ref, spec, steps[k].unused_on_rank0 if r == 0 else ())
            losses.append((ref.model(on_rank_device(data(spec, k, r))) ** 2).sum())
        total = sum(losses) / world
        if total.requires_grad:
            total.backward()
    pass_over(ref, spec, ())
    out = []
    scale = dict(predict_microbatch(spec).grad_scale)  # an all-reduce hook's, on its group's gradients
    grads = full_tensors({f: read_attr(model, f).grad for f in names})  # a collective: every rank runs it
    for f in names:
        full = None if grads[f] is None else grads[f].float()
        r = read_attr(ref.model, f).grad
        if full is None or r is None:
            out.append(GradSeen(f, full is None, r is None, 0.0 if (full is None) == (r is None) else -1.0))
            continue
        err = rel_err(full, scale.get(f, 1.0) * r)  # a NaN against a finite reference is an infinite error
        out.append(GradSeen(f, False, False, err))
    return out
