"""A pytest plugin (``-p tests.self.fault_plugin``) that injects a fault into
FSDP in the pytest process of a `fsdp-conformance run` / `hunt` that a
self-test starts: the pre-wrap simulation behind _validate_frozen_params
adds a "ghost" parameter to every non-empty unit, frozen where the unit
trains and trainable where it is frozen, so FSDP warns about (or rejects)
every uniform unit (FROZEN-CLEAN). The ghost is no parameter of the model, so
no known finding about aliased parameters explains the warning. Reaches the
fake tier (in-process) only."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import _wrap_utils

_orig = _wrap_utils._get_managed_param_to_fqn


def _ghost(*args, **kwargs):
    out = _orig(*args, **kwargs)
    if out:
        trains = any(p.requires_grad for p in out)
        out[nn.Parameter(torch.zeros(1), requires_grad=not trains)] = "ghost"
    return out


_wrap_utils._get_managed_param_to_fqn = _ghost
