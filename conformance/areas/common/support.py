"""What the installed torch can run here, per API and tier: an invariant whose
API this release lacks (or cannot run on this machine) is a SKIP with the
reason from here, never a crash. Version differences of FSDP's private API
live in the other adapters; this module only answers "can it run?".

Measured with the release matrix (ci/matrix.py, reports/matrix/)."""

from __future__ import annotations

import functools
import importlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn


def _release() -> str:
    return torch.__version__.split("+")[0]


@functools.cache
def fsdp2_unavailable() -> str | None:
    """Why FSDP2 cannot run a forward on this machine's CPU, or None.

    torch 2.4's FSDP2 (torch.distributed._composable.fsdp) creates CUDA
    streams in its lazy init whatever the device; torch 2.6's makes CPU
    streams but its forward records events on them, which a CPU Stream cannot:
    on a machine without a usable GPU the first forward raises. Probed, not
    assumed from the version: the comm context is built the way fully_shard's
    lazy init builds it, and an event recorded on its all-gather stream."""
    ctx_cls = None
    for name in ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "torch.distributed._composable.fsdp._fsdp_param_group"):
        try:
            ctx_cls = importlib.import_module(name).FSDPCommContext
            break
        except (ImportError, AttributeError):
            continue
    if ctx_cls is None:
        return f"torch {_release()} has no FSDP2 (fully_shard)"
    ctx = ctx_cls()
    try:
        if hasattr(ctx, "lazy_init"):  # torch >= 2.5: the device is an argument
            ctx.lazy_init(torch.device("cpu"))
        else:
            ctx.init()  # torch 2.4: CUDA streams, unconditionally
        # the forward records events on those streams: torch 2.6's CPU
        # Stream has no record_event
        ctx.all_gather_stream.record_event()
    except Exception as e:  # noqa: BLE001 - any failure means it cannot run here
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"FSDP2 in torch {_release()} cannot run on CPU here (its stream setup raised {type(e).__name__}: {first})"
    return None


def unavailable(api: str, scenario: str, tier: str) -> str | None:
    """Why an example of ``api`` (fsdp1 | fsdp2) observed by ``scenario`` on
    ``tier`` cannot run with this torch here, or None."""
    if api == "fsdp2":
        return fsdp2_unavailable()
    return None


# ---- the rank's device ---------------------------------------------------------------
# Cases are built on CPU (deterministic from their seed), then placed on the
# rank's device: FSDP, the single-process reference and the inputs all run
# there, and observations keep only Python values (float(), bool()).


def rank_device() -> torch.device:
    """This rank's device: cuda:LOCAL_RANK when the default process group is
    NCCL's (the pool and the torchrun entry set that device current), else
    CPU (gloo, fake, no group)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def on_rank_device(obj):
    """``obj`` (a tensor, or a dict / list / tuple holding tensors) on the
    rank's device; unchanged on CPU."""
    device = rank_device()
    if device.type == "cpu":
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return type(obj)((k, on_rank_device(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(on_rank_device(v) for v in obj)
    return obj


def placed(built):
    """A conformance.case.build.Built moved to the rank's device (its model, and
    the device its example inputs are made on); a model built under
    torch.device("meta") stays there (param_init_fn / to_empty place it)."""
    device = rank_device()
    if device.type != "cpu":
        if not any(t.is_meta for t in (*built.model.parameters(), *built.model.buffers())):
            built.model.to(device)
        built.device = device
    return built


HSDP_MESH_DIMS = ("replicate", "shard")
_LAYOUTS: dict = {}


def cached_layout(key, make):
    """Meshes and groups made once per default group and shape (making them is
    collective, and a group per example would pile up), by every rank alike."""
    full = (id(dist.distributed_c10d._get_default_group()), *key)
    if full not in _LAYOUTS:
        for k in [k for k in _LAYOUTS if k[0] != full[0]]:
            del _LAYOUTS[k]
        _LAYOUTS[full] = make()
    return _LAYOUTS[full]


def hsdp_mesh(shape: tuple[int, int]):
    """The (replicate, shard) DeviceMesh over the default group."""
    from torch.distributed.device_mesh import init_device_mesh

    return cached_layout(("mesh", tuple(shape)), lambda: init_device_mesh(rank_device().type, tuple(shape), mesh_dim_names=HSDP_MESH_DIMS))


def fsdp2_mesh():
    """The 1-D mesh over the default group on the rank's device type, given
    to fully_shard explicitly: its default mesh is CUDA's whenever a GPU is
    visible, whatever the backend."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(rank_device().type, (dist.get_world_size(),))


def unchanged(after: torch.Tensor, before: torch.Tensor) -> bool:
    """A parameter's value is what it was: equal element for element, a NaN
    where there was a NaN (torch.equal calls a NaN changed: seed 1 of the
    thorough profile, a frozen parameter of a step after an overflowing
    float16 reduction)."""
    if after.shape != before.shape or after.dtype != before.dtype:
        return False
    if torch.equal(after, before):
        return True
    if not after.is_floating_point():
        return False
    return bool(((after == before) | (after.isnan() & before.isnan())).all())


def _distinct_modules(built):
    """(index, spec path, module) of each module of the case once (a shared
    module at its source path)."""
    seen = set()
    for k, (path, m) in enumerate(built.modules.items()):
        if id(m) not in seen:
            seen.add(id(m))
            yield k, path, m


def case_buffers(built) -> list[tuple[str, nn.Module, str]]:
    """(FQN, module, name) of every buffer of the case's own modules, the FQN
    by the spec's paths (a shared module's by its source path). Read from
    the module objects, not named_buffers(): once FSDP1 wraps a child, the
    names under it hold ``_fsdp_wrapped_module`` (FSDP's own named_buffers
    too), and a check that looked them up by the unwrapped model's names
    compared none of them."""
    return [(f"{path}.{name}" if path else name, m, name)
            for _, path, m in _distinct_modules(built) for name, b in m._buffers.items() if b is not None]


def add_rank_buffers(built, seed: int, names: tuple[tuple[str, bool], ...], salt: int) -> dict[str, torch.Tensor]:
    """Register the buffers ``names`` ((name, persistent) pairs) on every
    module of the case, each of 3 values drawn from ``seed``, the module
    and the name (so that every rank's seed gives its own values, and no two
    buffers agree by chance). Returns {FQN: value} (case_buffers' FQNs)."""
    out = {}
    for k, path, m in _distinct_modules(built):
        for i, (name, persistent) in enumerate(names):
            value = torch.randn(3, generator=torch.Generator().manual_seed(salt * (i + 1) + 7_919 * k + seed))
            m.register_buffer(name, value.to(rank_device()), persistent=persistent)
            out[f"{path}.{name}" if path else name] = value
    return out
