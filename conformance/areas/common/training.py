"""What every training area shares (PARITY, the checkpoints, the schedules):
one optimizer factory, the single-process reference of data-parallel
training, and the tolerances and divergence test that judge FSDP's values
against it."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from conformance.areas.common.support import placed
from conformance.case.build import build

# One forward (a registered method, the FSDP1 workaround) against the
# unsharded model: the same arithmetic up to the order of a few sums.
FORWARD_RTOL, FORWARD_ATOL = 1e-4, 1e-5
# Training accumulates rounding differences (reduce-scatter averages in
# another order than one process sums): looser than a single forward.
TRAIN_RTOL, TRAIN_ATOL = 1e-3, 1e-5

# A reference that is well conditioned computes the same in float32 as in
# float64 up to a few roundings; one that is not (a loss that grows a
# hundredfold in three steps, seed 12: fp32 and fp64 references 2.9e-4
# apart, FSDP 9.9e-5 from the fp32 one) moves by as much under any other
# summation order. Training comparisons allow NOISE_FACTOR times the fp32
# reference's own distance from the fp64 one on top of the tolerance: a
# correct FSDP stays inside it, a missing reduction or a wrong average (an
# O(1) relative error) does not.
NOISE_FACTOR = 4.0

# A reference whose loss grows past this factor (or stops being finite) has
# diverged: from there rounding differences between two summation orders
# grow without bound, so no tolerance can judge parity and the values are
# not compared (errors and frozen gradients still are).
DIVERGED = 1e3

OPTIMIZERS = ("SGD", "Adam", "AdamW")

# Adam's step is scale-free: with the default eps (1e-8) a gradient that is
# zero in exact arithmetic but rounding noise (the weight of a LayerNorm over
# one element, seed 66; a LayerNorm weight under a mean, seed 2602) moves its
# parameter by a whole lr, in a direction the noise picks, so two correct
# summation orders end lr apart. eps=1e-3 keeps gradients well above 1e-3
# normalised as Adam does, and turns a 1e-7 noise gradient into a 1e-4 lr
# step, inside the tolerance.
ADAM_EPS = 1e-3


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    """The optimizer every training area builds, on FSDP's model and on the
    reference alike: SGD with momentum 0.9, Adam, or AdamW (weight decay
    0.1, so that decay shows), the Adams with ADAM_EPS. ``params`` as given:
    a caller that keeps frozen parameters in (they may train later) passes
    them."""
    params = list(params)
    if name == "Adam":
        return torch.optim.Adam(params, lr=lr, eps=ADAM_EPS)
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, eps=ADAM_EPS)
    if name == "SGD":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}; one of {OPTIMIZERS}")


def reference_loss(forward, batches: list[torch.Tensor], divide: float | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The single-process reference of one data-parallel microbatch: the
    loss ``(forward(x) ** 2).sum()`` of every rank's batch, their sum divided
    by ``divide`` (default: the number of batches, the mean FSDP's averaging
    reduction gives), and each batch's own loss. The caller runs backward on
    the total (when it needs a gradient) and steps its optimizer."""
    per_rank = [(forward(x).float() ** 2).sum() for x in batches]
    total = torch.stack(per_rank).sum() / (divide or len(batches))
    return total, per_rank


def stable(losses: list[float], model: nn.Module) -> bool:
    """Whether the reference stayed finite and within DIVERGED of its start."""
    if not losses or not all(math.isfinite(v) for v in losses):
        return False
    if max(abs(v) for v in losses) > DIVERGED * max(abs(losses[0]), 1.0):
        return False
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def noise(ref32: dict[str, torch.Tensor], ref64: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per name, the elementwise distance of the float32 reference from the
    same training run in float64 (the reference's own rounding noise)."""
    return {f: (v.detach().double() - ref64[f].detach().double()).abs().float()
            for f, v in ref32.items() if f in ref64 and ref64[f].shape == v.shape}


def reference_noise(spec, train, values, ref_values: dict[str, torch.Tensor],
                    ref_losses: list[float]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The float32 reference's own rounding noise, from the same training of
    a fresh build of ``spec`` in float64 (``train(spec, model, x0)`` returns
    its losses first; ``values(model)`` names its parameters as
    ``ref_values`` does): per name the elementwise distance of
    ``ref_values`` from it (``noise``), and per step that of ``ref_losses``."""
    ref64 = placed(build(spec))
    ref64.model.double()
    losses64 = train(spec, ref64.model, ref64.example_input().double())[0]
    loss_floor = (torch.tensor(ref_losses, dtype=torch.float64) - torch.tensor(losses64, dtype=torch.float64)).abs().float()
    return noise(ref_values, values(ref64.model)), loss_floor


def train_close(got: torch.Tensor, want: torch.Tensor, floor: torch.Tensor | float = 0.0) -> bool:
    """``got`` equals ``want`` within the training tolerance plus
    NOISE_FACTOR times the reference's noise ``floor`` (a tensor of
    ``want``'s shape, or a number)."""
    if got.shape != want.shape:
        return False
    got, want = got.detach().float(), want.detach().float()
    bound = TRAIN_ATOL + TRAIN_RTOL * want.abs() + NOISE_FACTOR * (floor.to(want.device) if isinstance(floor, torch.Tensor) else floor)
    return bool(((got - want).abs() <= bound).all()) or bool(torch.equal(got, want))


def diverged(start: dict[str, torch.Tensor], now: dict[str, torch.Tensor]) -> bool:
    """Whether any value stopped being finite or grew past DIVERGED times its
    initial size (the values-only form of ``stable``)."""
    for fqn, v in now.items():
        if not bool(torch.isfinite(v).all()):
            return True
        s = start[fqn]
        if v.numel() and v.abs().max().item() > DIVERGED * max(s.abs().max().item() if s.numel() else 0.0, 1.0):
            return True
    return False


def rel_err(a: torch.Tensor, b: torch.Tensor, slack: torch.Tensor | None = None) -> float:
    """max |a - b| / (1 + max |b|) over the elements (0-d tensors too); with
    ``slack``, only the distance beyond it, element by element. Non-finite
    values: where both sides are (an overflow the promise itself makes: inf,
    or the NaN that follows) they agree; where one side is, the error is
    infinite (a NaN would compare below any tolerance and pass)."""
    a, b = a.detach().float(), b.detach().float()
    if not a.numel():
        return 0.0
    d = (a - b).abs()
    if slack is not None:
        d = (d - slack.to(d.device).reshape(d.shape)).clamp_min(0.0)
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    d = torch.where(~fa & ~fb, torch.zeros_like(d), torch.where(fa & fb, d, torch.full_like(d, math.inf)))
    scale = 1.0 + (float(b[fb].abs().max()) if bool(fb.any()) else 0.0)
    return float(d.max()) / scale
