"""Communication adapter: shard a built case (FSDP2 groups or FSDP1 units),
run the comm plan's forward/backward iterations, and record every
collective (from the dispatcher: op, numel, dtype) attributed to the FSDP2
parameter group or FSDP1 unit that issued it, with FSDP2's unshard /
reshard / post-backward events. The only module of this area that touches
FSDP internals (it patches FSDPParamGroup's and FSDP1's runtime hooks for
the duration of one observation)."""

from __future__ import annotations

import contextlib
import time
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.utils._python_dispatch import TorchDispatchMode

from conformance.areas.comm.observation import CollectiveSeen, CommObservation, EventSeen, IterationSeen
from conformance.areas.common import fsdp1_adapter as a1
from conformance.areas.common.fsdp2_adapter import error_line, fsdp2_api
from conformance.areas.common.fsdp2_oracle import shard_order
from conformance.areas.common.support import fsdp2_mesh, on_rank_device, placed, rank_device
from conformance.case.build import build
from conformance.case.spec import CaseSpec
from conformance.case.target import graph_of

OPS = {"allgather": "all_gather", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "allreduce": "all_reduce",
       "all_reduce": "all_reduce"}


def _op(name: str) -> str:
    short = name.split(".")[-1].strip("_")
    for key, op in OPS.items():
        if short.startswith(key) or short.startswith("_" + key):
            return op
    return f"other:{short}"


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


class Recorder:
    """What one observation saw: collectives from the dispatcher (under
    ``mode``), attributed to the group or unit on top of ``owner``; events;
    the phase ("forward" / "backward") the caller sets."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.owner: list[tuple[str, str]] = []  # (group or unit, FSDP1 hook context)
        self.collectives: list[CollectiveSeen] = []
        self.events: list[EventSeen] = []
        rec = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func.overloadpacket)
                if name.startswith(("c10d.", "_c10d_functional.")):
                    rec.collective(name, args)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def collective(self, name: str, args) -> None:
        op = _op(name)
        tensors = [a for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
        group, ctx = self.owner[-1] if self.owner else ("?", "")
        # all-gathers: (outputs..., input), the tensor form or the list form;
        # reduce-scatters: (output, inputs...)
        if op == "all_gather" and len(tensors) >= 2:
            numel = sum(t.numel() for t in tensors[:-1])
            ranks = numel // max(tensors[-1].numel(), 1)
        elif op == "reduce_scatter" and len(tensors) >= 2:
            numel = sum(t.numel() for t in tensors[1:])
            ranks = numel // max(tensors[0].numel(), 1)
        else:
            numel, ranks = (tensors[0].numel() if tensors else 0), dist.get_world_size()
        dtype = _dtype_name(tensors[0].dtype) if tensors else "?"
        self.collectives.append(CollectiveSeen(self.phase, op, group, numel, ranks, dtype, ctx))

    @contextlib.contextmanager
    def owning(self, group: str, ctx: str = ""):
        self.owner.append((group, ctx))
        try:
            yield
        finally:
            self.owner.pop()

    def take(self, backward: bool) -> IterationSeen:
        out = IterationSeen(tuple(self.collectives), tuple(self.events), backward)
        self.collectives, self.events = [], []
        return out


# ---- FSDP2 ---------------------------------------------------------------------

_SINGLETONS: dict[int, object] = {}


def _one_rank_mesh():
    """A mesh of this rank alone: every rank makes every singleton group
    (new_group is collective), once per default group."""
    from torch.distributed.device_mesh import DeviceMesh

    key = id(dist.group.WORLD)
    if key not in _SINGLETONS:
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        _SINGLETONS.clear()
        _SINGLETONS[key] = groups[dist.get_rank()]
    return DeviceMesh.from_group(_SINGLETONS[key], rank_device().type)


def _fsdp2_patches(rec: Recorder, labels: dict[int, str]):
    """FSDPParamGroup's unshard, reshard and post_backward, recording the
    events and owning the collectives they issue."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    orig_unshard, orig_reshard, orig_post = FSDPParamGroup.unshard, FSDPParamGroup.reshard, FSDPParamGroup.post_backward

    def label(g) -> str:
        return labels.get(id(g.modules[0]), "?") if g.modules else "?"

    def state(g) -> str:
        return g._training_state.name

    def unshard(self, *args, **kwargs):
        before = self._all_gather_result is None and not self.is_unsharded
        with rec.owning(label(self)):
            out = orig_unshard(self, *args, **kwargs)
        if before and (self._all_gather_result is not None or self.is_unsharded):
            rec.events.append(EventSeen("unshard", label(self), state(self)))
        return out

    def reshard(self, *args, **kwargs):
        before = (self.is_unsharded, self.is_sharded_post_forward, self.is_sharded)
        st = state(self)
        out = orig_reshard(self, *args, **kwargs)
        if (self.is_unsharded, self.is_sharded_post_forward, self.is_sharded) != before:
            rec.events.append(EventSeen("reshard", label(self), st))
        return out

    def post_backward(self, *args, **kwargs):
        with rec.owning(label(self)):
            out = orig_post(self, *args, **kwargs)
        rec.events.append(EventSeen("post_backward", label(self), state(self)))
        return out

    return (mock.patch.object(FSDPParamGroup, "unshard", unshard), mock.patch.object(FSDPParamGroup, "reshard", reshard),
            mock.patch.object(FSDPParamGroup, "post_backward", post_backward))


def _shard2(spec: CaseSpec, built, mesh) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fully_shard, _, _ = fsdp2_api()
    c = spec.comm
    mp = MixedPrecisionPolicy(param_dtype=_dt(c.param_dtype), reduce_dtype=_dt(c.reduce_dtype))
    for grp in shard_order(spec.plan, graph_of(spec)):
        kwargs = {"mesh": mesh, "mp_policy": mp}
        if grp.reshard_after_forward is not None:
            kwargs["reshard_after_forward"] = grp.reshard_after_forward
        mods = [built.modules[p] for p in grp.modules]
        fully_shard(mods if len(mods) > 1 else mods[0], **kwargs)
    for which, setter in ((c.forward_prefetch, "set_modules_to_forward_prefetch"), (c.backward_prefetch, "set_modules_to_backward_prefetch")):
        for module, targets in which:
            getattr(built.modules[module], setter)([built.modules[t] for t in targets])


def _dt(name: str | None):
    return None if name is None else getattr(torch, name)


# ---- FSDP1 ---------------------------------------------------------------------


def _fsdp1_patches(rec: Recorder, units: dict[int, str]):
    """FSDP1's pre-forward unshard, pre- and post-backward hooks (the
    context of each collective) and _unshard (the unit whose flat parameter
    is all-gathered: a prefetch unshards another unit's)."""
    from torch.distributed.fsdp import _runtime_utils as ru

    def unit(handle) -> str:
        return units.get(id(handle), "?")

    o_unshard, o_pre_fwd, o_pre_bw, o_post_bw = ru._unshard, ru._pre_forward_unshard, ru._pre_backward_hook, ru._post_backward_hook
    ctx: list[str] = [""]

    def _unshard(state, handle, *args, **kwargs):
        with rec.owning(unit(handle), ctx[-1]):
            return o_unshard(state, handle, *args, **kwargs)

    def hooked(orig, name, handle_at):
        def run(*args, **kwargs):
            handle = args[handle_at]
            ctx.append(f"{name} {unit(handle)}")
            try:
                with rec.owning(unit(handle), ctx[-1]):
                    return orig(*args, **kwargs)
            finally:
                ctx.pop()

        return run

    from torch.distributed.fsdp import fully_sharded_data_parallel as fsdp_module

    pre_fwd = hooked(o_pre_fwd, "pre_forward", 1)
    return (mock.patch.object(ru, "_unshard", _unshard),
            # FullyShardedDataParallel.forward passes its own import of it to _pre_forward
            mock.patch.object(ru, "_pre_forward_unshard", pre_fwd), mock.patch.object(fsdp_module, "_pre_forward_unshard", pre_fwd),
            mock.patch.object(ru, "_pre_backward_hook", hooked(o_pre_bw, "pre_backward", 2)),
            mock.patch.object(ru, "_post_backward_hook", hooked(o_post_bw, "post_backward", 1)),
            mock.patch.object(ru, "_post_backward_reshard_only_hook", hooked(ru._post_backward_reshard_only_hook, "post_backward", 1)))


def _wrap1(spec: CaseSpec, built):
    c = spec.comm
    mp = None
    if c.param_dtype or c.reduce_dtype:
        mp = MixedPrecision(param_dtype=_dt(c.param_dtype), reduce_dtype=_dt(c.reduce_dtype))
    bp = None if c.fsdp1_backward_prefetch is None else BackwardPrefetch[c.fsdp1_backward_prefetch]
    return a1.wrap(spec, built, sharding_strategy=ShardingStrategy[c.sharding_strategy], backward_prefetch=bp,
                   forward_prefetch=c.fsdp1_forward_prefetch, limit_all_gathers=c.limit_all_gathers, mixed_precision=mp)


# ---- one observation -------------------------------------------------------------


def observe(spec: CaseSpec) -> CommObservation:
    """Shard or wrap the case, then run its iterations, each a forward and
    (when the loss requires grad) a backward, recording what FSDP
    communicates."""
    api = spec.plan.api
    c = spec.comm
    built = placed(build(spec))
    aliases = a1.Aliases(built.model)
    rec = Recorder()
    t0 = time.perf_counter()
    world = dist.get_world_size() if c.world == 0 else 1
    base = dict(api=api, rank=dist.get_rank(), world_size=world, backend=str(dist.get_backend()), torch_version=torch.__version__)
    try:
        if api == "fsdp2":
            _shard2(spec, built, fsdp2_mesh() if c.world == 0 else _one_rank_mesh())
            model = built.model
            labels = {id(m): aliases.canon_of_module.get(id(m), "?") for m in built.model.modules()}
            patches = _fsdp2_patches(rec, labels)
        else:
            model = _wrap1(spec, built)
            units = {id(u._handle): aliases.canon_of_module.get(id(u.module), "?") for u in FSDP.fsdp_modules(model)
                     if getattr(u, "_handle", None) is not None}
            patches = _fsdp1_patches(rec, units)
    except Exception as e:
        return CommObservation(**base, error=f"wrapping: {error_line(e)}", seconds=time.perf_counter() - t0)
    x = on_rank_device(torch.linspace(-1.0, 1.0, 2, device=rank_device()))
    iterations = []
    error = None
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        for i in range(c.iterations):
            try:
                rec.phase = "forward"
                with rec.mode:
                    out = model(x)
                loss = (out.float() ** 2).sum()
                rec.phase = "backward"
                if loss.requires_grad:
                    with rec.mode:
                        loss.backward()
                iterations.append(rec.take(loss.requires_grad))
                for p in model.parameters():
                    p.grad = None
            except Exception as e:
                error = f"iteration {i}: {error_line(e)}"
                iterations.append(rec.take(True))
                break
    return CommObservation(**base, error=error, iterations=tuple(iterations), seconds=time.perf_counter() - t0)
