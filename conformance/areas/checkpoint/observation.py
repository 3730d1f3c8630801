"""What a checkpoint scenario saw on one rank (SD-FULL, TIES-KEPT,
CKPT-RESHARD, OPTIM-STATE): pure data."""

from __future__ import annotations

from dataclasses import dataclass

from conformance.case.data import Record


@dataclass(frozen=True)
class CkptObservation(Record):
    kind: str  # "sd-full" | "ties" | "roundtrip"
    api: str  # the API the observing side wrapped with
    rank: int
    world_size: int
    backend: str
    torch_version: str
    error: str | None = None  # "Type: first line" of what raised
    phase: str | None = None  # where it raised: wrap, train, state_dict, save, load, resume
    skipped: str | None = None  # an API this torch lacks: why the case could not run
    # SD-FULL: the full state dict against the unwrapped model's
    keys: tuple[str, ...] = ()
    wrong_values: tuple[str, ...] = ()  # keys whose shape or values differ (TIES-KEPT: or dtype)
    wrong_dtypes: tuple[tuple[str, str], ...] = ()  # SD-FULL: (key, its dtype) where that differs from the unwrapped model's
    rounded: tuple[str, ...] = ()  # SD-FULL: wrong values that are the unwrapped model's rounded through buffer_dtype
    not_plain: tuple[str, ...] = ()  # keys holding a DTensor / ShardedTensor or a non-CPU tensor where CPU was asked
    # TIES-KEPT
    ties: tuple[tuple[str, bool], ...] = ()  # (canonical FQN, every alias is one Parameter)
    params_before: int = 0
    params_after: int = 0
    forward_loss: tuple[float, float] | None = None  # (the loaded model's first loss, the unwrapped model's with the same state); None: not run (fake tier)
    # CKPT-RESHARD / OPTIM-STATE (load side; the save side's record is ``save``)
    model_diff: tuple[str, ...] = ()  # loaded model value differs from the saved one (or key missing / extra)
    optim_saved: tuple[str, ...] = ()  # FQNs with optimizer state in the saved full optimizer state dict
    optim_loaded: tuple[str, ...] = ()  # ... after the load
    optim_ref: tuple[str, ...] = ()  # canonical FQNs with state in single-process training at the save
    optim_diff: tuple[str, ...] = ()  # "fqn.key": loaded state differs from the saved
    optim_ref_diff: tuple[str, ...] = ()  # "fqn.key": saved state differs from single-process training's
    groups_diff: tuple[str, ...] = ()  # param_groups hyperparameters that differ after the load
    # (group index, names only the loaded group has, names only the saved one has)
    groups_params: tuple[tuple[int, tuple[str, ...], tuple[str, ...]], ...] = ()
    resume_ref_diff: tuple[str, ...] = ()  # params after resumed training differ from single-process training
    resume_cont_diff: tuple[str, ...] | None = None  # ... from the uninterrupted run (None: not compared)
    save: dict | None = None  # the save phase's observation (rank 0), for two-phase cases
    seconds: tuple[tuple[str, float], ...] = ()  # (what, seconds): fsdp, dcp, total

    @property
    def values_meaningful(self) -> bool:
        return self.backend != "fake"


    def comparable(self) -> dict:
        """What every rank must agree on. Full state dicts and what raised
        are per rank by design (rank0_only, cpu_offload: the others get an
        empty dict): SD-FULL and the others check those rank by rank."""
        d = self.to_dict()
        for k in ("rank", "seconds", "save", "keys", "wrong_values", "wrong_dtypes", "rounded", "not_plain", "error", "phase"):
            d.pop(k)
        return d
