"""A pytest plugin (``-p tests.self.fault_plugin``) that injects a fault into
FSDP in the pytest process of a `fsdp-conformance run` / `hunt` that a
self-test starts: the pre-wrap simulation behind _validate_frozen_params
reports a frozen "ghost" parameter in every non-empty unit, so FSDP warns
about uniform units (FROZEN-CLEAN). Reaches the fake tier (in-process) only."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import _wrap_utils

_orig = _wrap_utils._get_managed_param_to_fqn


def _ghost(*args, **kwargs):
    out = _orig(*args, **kwargs)
    if out:
        out[nn.Parameter(torch.zeros(1), requires_grad=False)] = "ghost"
    return out


_wrap_utils._get_managed_param_to_fqn = _ghost
