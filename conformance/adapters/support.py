"""What the installed torch can run here, per API and tier: an invariant whose
API this release lacks (or cannot run on this machine) is a SKIP with the
reason from here, never a crash. Version differences of FSDP's private API
live in the other adapters; this module only answers "can it run?".

Measured with the release matrix (ci/matrix.py, reports/matrix/)."""

from __future__ import annotations

import functools
import importlib

import torch


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
