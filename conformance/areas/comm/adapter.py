"""Communication adapter: shard a built case (FSDP2 groups or FSDP1 units),
run the comm plan's forward/backward iterations, and record every
collective (from the dispatcher: op, numel, dtype) attributed to the FSDP2
parameter group or FSDP1 unit that issued it, with FSDP2's unshard /
reshard / post-backward events. The only module of this area that touches
FSDP internals (it patches FSDPParamGroup's and FSDP1's runtime hooks for
the duration of one observation)."""

from __future__ import annotations

import contextlib
import re
import time
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from conformance.areas.comm.observation import CommObservation
from conformance.areas.common import fsdp1_adapter as a1
from conformance.areas.common.comm_adapter import Recorder, dtype_of, fsdp2_patches, one_rank_mesh
from conformance.areas.common.fsdp2_adapter import error_line, fsdp2_api
from conformance.areas.common.fsdp2_oracle import shard_order
from conformance.areas.common.support import fsdp2_mesh, on_rank_device, placed, rank_device
from conformance.case.build import build, read_attr
from conformance.case.spec import CaseSpec
from conformance.case.target import graph_of


def _shard2(spec: CaseSpec, built, mesh) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fully_shard, _, _ = fsdp2_api()
    c = spec.comm
    mp = MixedPrecisionPolicy(param_dtype=dtype_of(c.param_dtype), reduce_dtype=dtype_of(c.reduce_dtype))
    for grp in shard_order(spec.plan, graph_of(spec)):
        kwargs = {"mesh": mesh, "mp_policy": mp}
        if grp.reshard_after_forward is not None:
            kwargs["reshard_after_forward"] = grp.reshard_after_forward
        mods = [built.modules[p] for p in grp.modules]
        fully_shard(mods if len(mods) > 1 else mods[0], **kwargs)
    for which, setter in ((c.forward_prefetch, "set_modules_to_forward_prefetch"), (c.backward_prefetch, "set_modules_to_backward_prefetch")):
        for module, targets in which:
            getattr(built.modules[module], setter)([built.modules[t] for t in targets])


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
        mp = MixedPrecision(param_dtype=dtype_of(c.param_dtype), reduce_dtype=dtype_of(c.reduce_dtype))
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
            _shard2(spec, built, fsdp2_mesh() if c.world == 0 else one_rank_mesh())
            model = built.model
            labels = {id(m): aliases.canon_of_module.get(id(m), "?") for m in built.model.modules()}
            patches = fsdp2_patches(rec, labels)
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
            no_sync = bool(c.fsdp1_no_sync) and c.fsdp1_no_sync[i]
            try:
                with model.no_sync() if no_sync else contextlib.nullcontext():
                    rec.phase = "forward"
                    with rec.mode:
                        out = model(x)
                    loss = (out.float() ** 2).sum()
                    rec.phase = "backward"
                    if loss.requires_grad:
                        with rec.mode:
                            loss.backward()
                iterations.append(rec.take(loss.requires_grad))
                if not no_sync:  # gradients accumulate across no_sync iterations, as in a training loop
                    for p in model.parameters():
                        p.grad = None
                if i == 0 and c.refreeze:  # requires_grad flips for the later iterations
                    for f in c.refreeze:
                        p = read_attr(built.model, f)
                        p.requires_grad_(not p.requires_grad)
            except Exception as e:
                # without object addresses (FSDP1's hook-state assertion prints
                # one), which would make the ranks' identical errors disagree
                error = re.sub(r" at 0x[0-9a-f]+", "", f"iteration {i}: {error_line(e)}")
                iterations.append(rec.take(True))
                break
    return CommObservation(**base, error=error, iterations=tuple(iterations), seconds=time.perf_counter() - t0)
