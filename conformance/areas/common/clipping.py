"""The single-process side of gradient clipping, shared by the clip and tp
areas: the total norm by its definition, and whether a clipping function's
norm agrees with it (a norm that overflows agrees only with the same
overflow)."""

from __future__ import annotations

import math

import torch


def reference_norm(grads: list[torch.Tensor], norm_type: float) -> float:
    """The single-process total norm, by its definition rather than by the
    clip_grad functions under test: the norm of every gradient flattened
    into one vector (0 for none)."""
    if not grads or not any(g.numel() for g in grads):
        return 0.0
    return float(torch.linalg.vector_norm(torch.cat([g.detach().flatten().float() for g in grads]), norm_type))


def norm_agrees(norm: float, want: float, rtol: float, atol: float) -> bool:
    """``norm`` within tolerance of ``want``; where ``want`` is not finite
    (a 3-norm of gradients above ~1e13 overflows float32), the same inf or
    nan: inf - inf is nan, which no tolerance admits."""
    if not math.isfinite(want):
        return norm == want or (math.isnan(norm) and math.isnan(want))
    return abs(norm - want) <= rtol * abs(want) + atol
