"""What training with activation checkpointing under either API did on one
rank (AC-PARITY, AC-STATE-DICT, AC-ALLGATHER): pure data."""

from __future__ import annotations

from dataclasses import dataclass

from conformance.areas.common.observation import GradObservation
from conformance.case.data import Record


@dataclass(frozen=True)
class ACObservation(Record):
    api: str
    rank: int
    world_size: int
    backend: str
    torch_version: str
    ac_error: str | None = None  # applying the checkpointing raised
    wrap_error: str | None = None
    step_error: str | None = None  # some rank's training with AC raised (the ranks agree on it)
    state_dict_error: str | None = None  # some rank's model.state_dict() after training raised
    losses: tuple[float, ...] = ()  # this rank's loss per step, with AC under FSDP
    ref_losses: tuple[float, ...] = ()  # the same batch's loss, single-process training without AC
    losses_close: bool | None = None
    params: tuple[GradObservation, ...] = ()  # close: final value equals single-process training's
    frozen_grads_none: tuple[tuple[str, bool], ...] = ()
    ref_stable: bool = True
    state_dict_keys: tuple[str, ...] = ()  # model.state_dict() after training, with AC
    plain_keys: tuple[str, ...] = ()  # the same model's keys without FSDP and AC
    # the parameter all-gathers each step issued, as (step, phase, group,
    # count): phase forward | backward; group the FSDP2 group's first module
    # or the FSDP1 unit whose flat parameter was gathered (canonical paths)
    gathers: tuple[tuple[int, str, str, int], ...] = ()
    # the same FSDP run of the case without AC (None: it raised)
    plain_gathers: tuple[tuple[int, str, str, int], ...] | None = None
    plain_error: str | None = None  # the same FSDP training without AC raised (FSDP's failure, not AC's)
    # (step, checkpointed module, calls of its forward in forward, in
    # backward, -): with AC; plain_calls: the same FSDP run without AC, the
    # last count the tensors autograd saved for backward inside its calls
    calls: tuple[tuple[int, str, int, int, int], ...] = ()
    plain_calls: tuple[tuple[int, str, int, int, int], ...] = ()
    seconds: float = 0.0
    fsdp_seconds: float = 0.0  # wrapping, training with and without AC, reading the full values and the state dict (the reference excluded)

    @property
    def values_meaningful(self) -> bool:
        return self.backend != "fake" and self.ref_stable

    def comparable(self) -> dict:
        d = self.to_dict()
        for k in ("rank", "seconds", "fsdp_seconds", "losses", "ref_losses"):
            d.pop(k)
        for p in d["params"]:
            p.pop("max_diff")
        return d
