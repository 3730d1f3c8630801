"""The toy LM with a forward that warns every call (as FSDP2's "returned a
view tensor" warning does on a real model): a model run must count such
warnings into its report, not print each one."""

from __future__ import annotations

import dataclasses
import warnings

from conformance.models import toy_target


class WarningLM(toy_target.ToyLM):
    def forward(self, input_ids, labels=None):
        warnings.warn("WarningLM.forward: a deliberate warning per call", UserWarning, stacklevel=1)
        return super().forward(input_ids, labels)


def make_model(seed: int) -> WarningLM:
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return WarningLM()


target = dataclasses.replace(toy_target.target, name="warning-lm", factory=make_model)
