"""What the comm and microbatch areas' adapters share: the recorder of the
collectives a rank issues (from the dispatcher: op, numel, ranks, dtype),
attributed to the FSDP2 parameter group or FSDP1 unit that issued them, the
patches of FSDPParamGroup's unshard / reshard / post_backward that record
FSDP2's events, and a one-rank mesh. Touches FSDP2 internals
(FSDPParamGroup)."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from conformance.areas.common.comm_observation import CollectiveSeen, EventSeen, IterationSeen
from conformance.areas.common.support import rank_device

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


def process_group(args):
    """The process group a c10d op runs on (its ScriptObject argument), or None."""
    for a in torch.utils._pytree.tree_leaves(args):
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a)
            except Exception:  # noqa: BLE001 - another ScriptObject (a reduce op, a work handle)
                continue
    return None


def group_size(args) -> int:
    """The size of the process group a c10d op runs on, or the world size
    where it names none: a 2-D mesh's all-reduce spans its replicate dim,
    not the world."""
    pg = process_group(args)
    return dist.get_world_size() if pg is None else pg.size()


# op -> its name where it is a collective, else "": every op of a recorded
# forward and backward passes through the mode, most of them many times
_COLLECTIVE_NAMES: dict = {}


def _collective_name(func) -> str:
    name = str(func.overloadpacket)
    return name if name.startswith(("c10d.", "_c10d_functional.")) else ""


class Recorder:
    """What one observation saw: collectives from the dispatcher (under
    ``mode``), attributed to the group or unit on top of ``owner``; events;
    the phase ("forward" / "backward") the caller sets."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.owner: list[tuple[str, str]] = []  # (group or unit, FSDP1 hook context)
        self.via: list[str] = []  # the custom comm a collective goes through (FSDP2)
        # FSDP2: the mesh's shard group, where the caller tells it; then every
        # reduce-scatter on another process group is labelled "separate N"
        # (the N-th such group seen)
        self.shard_group = None
        self._separate: list = []
        self.collectives: list[CollectiveSeen] = []
        self.events: list[EventSeen] = []
        rec = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = _COLLECTIVE_NAMES.get(func)
                if name is None:
                    name = _COLLECTIVE_NAMES[func] = _collective_name(func)
                if name:
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
            numel, ranks = (tensors[0].numel() if tensors else 0), group_size(args)
        dtype = _dtype_name(tensors[0].dtype) if tensors else "?"
        self.collectives.append(CollectiveSeen(self.phase, op, group, numel, ranks, dtype, ctx, via=self.via[-1] if self.via else "",
                                               pg=self._pg_label(op, args)))

    def _pg_label(self, op: str, args) -> str:
        # reduce-scatters only: an all-gather after an int reshard_after_forward runs on a group of the mesh's own
        if self.shard_group is None or op != "reduce_scatter":
            return ""
        pg = process_group(args)
        if pg is None or pg is self.shard_group:
            return ""
        for i, seen in enumerate(self._separate):
            if seen is pg:
                return f"separate {i + 1}"
        self._separate.append(pg)
        return f"separate {len(self._separate)}"

    def restart(self) -> None:
        """Forget what was seen (an aborted iteration's): the separate
        process groups are numbered afresh from the next collective."""
        self.collectives, self.events, self._separate = [], [], []

    def hook_call(self, tensor: torch.Tensor) -> None:
        """An FSDP2 all-reduce hook's call, attributed to the group whose
        post-backward runs it, with the tensor it was given."""
        group = self.owner[-1][0] if self.owner else "?"
        self.collectives.append(CollectiveSeen(self.phase, "all_reduce_hook", group, tensor.numel(), 1, _dtype_name(tensor.dtype)))

    @contextlib.contextmanager
    def through(self, via: str):
        """Collectives issued inside are tagged ``via`` (a custom comm's own)."""
        self.via.append(via)
        try:
            yield
        finally:
            self.via.pop()

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

_SINGLETONS: list = []  # [the default group they were made in, this rank's singleton group]


def one_rank_mesh():
    """A mesh of this rank alone: every rank makes every singleton group
    (new_group is collective), once per default group (held, not its id: a
    default group made after another was destroyed may reuse the address)."""
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.group.WORLD
    if not _SINGLETONS or _SINGLETONS[0] is not world:
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        _SINGLETONS[:] = [world, groups[dist.get_rank()]]
    return DeviceMesh.from_group(_SINGLETONS[1], rank_device().type)


def fsdp2_patches(rec: Recorder, labels: dict[int, str]):
    """FSDPParamGroup's unshard, reshard and post_backward, recording the
    events and owning the collectives they issue."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    orig_unshard, orig_reshard, orig_post = FSDPParamGroup.unshard, FSDPParamGroup.reshard, FSDPParamGroup.post_backward

    def label(g) -> str:
        # a list group by all its modules, as fully_shard was given them (the
        # oracle's name: ", "-joined), a one-module group by its module
        return ", ".join(labels.get(id(m), "?") for m in g.modules) if g.modules else "?"

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


def dtype_of(name: str | None):
    return None if name is None else getattr(torch, name)


# ---- FSDP2's user-supplied comms ----------------------------------------------


def custom_comms(rec: Recorder, label: str):
    """The suite's AllGather and ReduceScatter for the group ``label``
    (FSDPModule.set_custom_all_gather / set_custom_reduce_scatter): the
    collectives FSDP's defaults issue, through plain buffers, each tagged
    "custom <label>" in the recorder, so that a collective of the group that
    bypasses them (or goes through another group's) is told apart."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    # the single-tensor forms (torch 2.13 deprecates the *_tensor names)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    via = f"custom {label}"

    class SuiteAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            with rec.through(via):
                return gather(output_tensor, input_tensor, group=group, async_op=async_op)

    class SuiteReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            with rec.through(via):
                return scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    return SuiteAllGather(), SuiteReduceScatter()


def scaling_hook(rec: Recorder, scale: float):
    """An all-reduce hook (FSDPModule.set_all_reduce_hook) that records its
    call and multiplies the tensor it is given in place by ``scale``, as a
    user's hook all-reduces it in place: the group's gradients come out
    ``scale`` times the large batch's."""

    def hook(output: torch.Tensor) -> None:
        rec.hook_call(output)
        output.mul_(scale)

    return hook
