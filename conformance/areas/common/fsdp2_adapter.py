"""FSDP2 as the areas apply it: the fully_shard API of the installed torch
(public from 2.6, torch.distributed._composable.fsdp before), a WrapPlan's
groups sharded bottom-up, and what several areas read of FSDP2 modules."""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from conformance.areas.common.fsdp2_oracle import shard_order
from conformance.areas.common.support import fsdp2_mesh
from conformance.case.build import Built, is_sharded
from conformance.case.spec import CaseSpec
from conformance.case.target import graph_of


def fsdp2_api():
    """(fully_shard, FSDPModule, register_fsdp_forward_method): public in
    torch.distributed.fsdp from 2.6, torch.distributed._composable.fsdp before."""
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
    except ImportError:  # torch 2.4, 2.5
        from torch.distributed._composable.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
    return fully_shard, FSDPModule, register_fsdp_forward_method


def takes_ignored_params() -> bool:
    """Whether this torch's fully_shard takes ``ignored_params`` (2.7 on)."""

    try:
        return "ignored_params" in inspect.signature(fsdp2_api()[0]).parameters
    except (ImportError, TypeError, ValueError):
        return False


def has_reduction_setters() -> bool:
    """Whether this torch's FSDPModule has set_force_sum_reduction_for_comms
    and set_gradient_divide_factor (2.8 on)."""
    try:
        FSDPModule = fsdp2_api()[1]
    except ImportError:
        return False
    return all(hasattr(FSDPModule, n) for n in ("set_force_sum_reduction_for_comms", "set_gradient_divide_factor"))


def set_reduction(model, force_sum: bool, divide_factor: float | None) -> None:
    """The plan's gradient reduction settings on every FSDP module of ``model``."""
    FSDPModule = fsdp2_api()[1]
    for m in model.modules():
        if isinstance(m, FSDPModule):
            if force_sum:
                m.set_force_sum_reduction_for_comms(True)
            if divide_factor is not None:
                m.set_gradient_divide_factor(divide_factor)


def count_collectives():
    """A dispatch mode that counts the collectives issued under it, by op
    name. (torch's CommDebugMode also tracks modules, and its module tracker
    breaks on a method that calls self(...) outside any module forward.)"""


    class CountCollectives(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if name.startswith(("c10d", "_c10d_functional")):
                self.counts[name] += 1
            return func(*args, **(kwargs or {}))

        def get_comm_counts(self):
            return self.counts

    return CountCollectives()


class MethodWatch:
    """What a registered method did inside: how many times its module's
    forward ran within it (``nested``: a method that calls self(...)), and
    how many ops read a sharded (DTensor) parameter of the model after such a
    nested forward had finished (``sharded_reads``): the mechanism of
    fsdp2-forward-method-calls-self, observed rather than guessed from the
    method's source."""

    def __init__(self) -> None:
        self.nested = 0
        self.sharded_reads = 0


@contextlib.contextmanager
def watch_method(module: torch.nn.Module | None):
    """A MethodWatch over one call of a method of ``module`` (None: a
    forward, not a method: nothing to watch)."""
    from torch.distributed.tensor import DTensor

    watch = MethodWatch()

    def after_forward(*_):
        watch.nested += 1

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            # a DTensor Parameter is a parameter FSDP2 holds sharded
            if watch.nested and any(isinstance(a, DTensor) and isinstance(a, torch.nn.Parameter) for a in (*args, *(kwargs or {}).values())):
                watch.sharded_reads += 1
            return func(*args, **(kwargs or {}))

    if module is None:
        yield watch
        return
    handle = module.register_forward_hook(after_forward, always_call=True)
    try:
        with Reads():
            yield watch
    finally:
        handle.remove()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The unsharded value of a DTensor (a collective: every rank calls it), or ``t``."""
    return t.full_tensor() if is_sharded(t) else t


def _one_dim_shard(t: torch.Tensor) -> int | None:
    """The dim a DTensor is sharded on, where it is plainly sharded on one
    dim of a 1-D mesh (FSDP2's Shard(0), in rank order); else None."""
    try:
        from torch.distributed.tensor import Shard
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import Shard
    placements = tuple(t.placements)
    if t.device_mesh.ndim != 1 or len(placements) != 1 or type(placements[0]) is not Shard or not t.dim():
        return None  # HSDP's and TP's meshes, _StridedShard, Replicate: full_tensor() itself
    if t.to_local().device.type != t.device_mesh.device_type:
        return None  # a CPU-offloaded shard of a GPU mesh
    return placements[0].dim % t.dim()


def full_tensors(tensors: dict) -> dict:
    """full_tensor() of every value (None and plain tensors as they are),
    detached, in few collectives: every rank calls it with the same keys,
    each key's value sharded alike on every rank. The DTensors sharded on
    one dim of a 1-D mesh (FSDP2's parameters and gradients) travel
    together, per mesh and device: one all-gather of their local sizes,
    one of their bytes, where full_tensor() makes a redistribute of each
    (about 4 ms apiece on 2 gloo ranks here, most of a training example's
    reads of its values). Any other DTensor: full_tensor()."""
    import torch.distributed as dist

    out: dict = {}
    batches: dict[tuple, list] = {}
    for key, t in tensors.items():
        if t is None or not is_sharded(t):
            out[key] = t if t is None else t.detach()
            continue
        dim = _one_dim_shard(t)
        if dim is None:
            out[key] = t.detach().full_tensor()
            continue
        local = t.to_local().detach()
        batches.setdefault((id(t.device_mesh), local.device), []).append((key, t, dim, local))
    for (_, device), items in batches.items():
        group = items[0][1].device_mesh.get_group()
        world = dist.get_world_size(group)
        if dist.get_backend(group) == "fake":  # its all-gathers leave their outputs unwritten: no sizes to read
            out.update((key, t.detach().full_tensor()) for key, t, _, _ in items)
            continue
        sizes = torch.tensor([local.shape[dim] for _, _, dim, local in items], dtype=torch.int64, device=device)
        all_sizes = [torch.empty_like(sizes) for _ in range(world)]
        dist.all_gather(all_sizes, sizes, group=group)
        all_sizes = [s.tolist() for s in all_sizes]
        mine_bytes = torch.cat([local.contiguous().reshape(-1).view(torch.uint8) for _, _, _, local in items])
        # every rank's byte count, from its sizes: the same shapes elsewhere
        widths = [[_local_numel(t.shape, dim, n) * local.element_size() for (_, t, dim, local), n in zip(items, rank_sizes)]
                  for rank_sizes in all_sizes]
        longest = max(sum(w) for w in widths)
        buf = torch.zeros(longest, dtype=torch.uint8, device=device)
        buf[: mine_bytes.numel()] = mine_bytes
        bufs = [torch.empty_like(buf) for _ in range(world)]
        dist.all_gather(bufs, buf, group=group)
        offsets = [0] * world
        for i, (key, t, dim, local) in enumerate(items):
            pieces = []
            for r in range(world):
                shape = list(t.shape)
                shape[dim] = all_sizes[r][i]
                n = widths[r][i]
                pieces.append(bufs[r][offsets[r]: offsets[r] + n].clone().view(local.dtype).reshape(shape))
                offsets[r] += n
            full = torch.cat(pieces, dim=dim)
            if full.shape != t.shape:
                raise RuntimeError(f"full_tensors: the shards of a {tuple(t.shape)} DTensor make {tuple(full.shape)}")
            out[key] = full
    return {key: out[key] for key in tensors}


def _local_numel(shape: torch.Size, dim: int, size: int) -> int:
    """The numel of a shard of ``shape`` holding ``size`` of its ``dim``."""
    numel = size
    for d, s in enumerate(shape):
        if d != dim:
            numel *= s
    return numel


def error_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"


def load_cause(e: BaseException) -> str:
    """nn.Module.load_state_dict's first line only names the module ("Error(s)
    in loading state_dict for X:"): the first copy that failed, and why, as
    ' <name>: <its exception>', or the missing / unexpected keys it names, so
    that a finding can match its own cause."""
    text = str(e)
    if not text.startswith("Error(s) in loading state_dict for "):
        return ""
    name, sep, rest = text.partition('While copying the parameter named "')
    if not sep:
        # strict loading's own complaint: the keys the model and the state dict do not share
        keys = next((line.strip() for line in text.splitlines() for what in ("Missing key(s)", "Unexpected key(s)") if what in line), "")
        return f" {' '.join(keys.split())[:200]}" if keys else ""
    param, _, after = rest.partition('"')
    why = after.partition("an exception occurred : (")[2].split("\n")[0].strip(" ('\",).")
    return f" {param}: {' '.join(why.split())[:200]}" if why else ""


def shard(spec: CaseSpec, built: Built, extra=None) -> None:
    """fully_shard bottom-up: each group (the multi-module form for several
    modules) after every group below it, the root last. ``extra(modules)``:
    more fully_shard kwargs for the group of those spec paths (mp_policy)."""
    fully_shard, _, _ = fsdp2_api()
    ignored = {built.model.get_parameter(f) for f in spec.plan.ignored_params}
    mesh = fsdp2_mesh()
    for grp in shard_order(spec.plan, graph_of(spec)):
        mods = [built.modules[p] for p in grp.modules]
        kwargs = {"mesh": mesh}
        if grp.reshard_after_forward is not None:
            kwargs["reshard_after_forward"] = grp.reshard_after_forward
        if ignored:
            kwargs["ignored_params"] = ignored
        if extra is not None:
            kwargs.update(extra(grp.modules))
        fully_shard(mods if len(mods) > 1 else mods[0], **kwargs)
