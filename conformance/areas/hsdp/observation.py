"""What HSDP training did with one case on one rank (HSDP-*): pure data."""

from __future__ import annotations

from dataclasses import dataclass

from conformance.areas.common.comm_observation import CollectiveSeen
from conformance.areas.common.observation import RankRecord


@dataclass(frozen=True)
class LocalSeen:
    """One parameter (FSDP2, or FSDP1 with use_orig_params=True: an original
    parameter's view; FSDP1 otherwise: a unit's flat parameter) as this rank
    holds it: placements (FSDP2's DTensor, "" otherwise), local and full
    shape."""

    name: str
    placements: str
    local_shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepSeen:
    """One step on this rank: a digest of every local gradient after the
    backward, of every local parameter after the optimizer step, of every
    buffer, by name (bit-identical local tensors have equal digests)."""

    grads: tuple[tuple[str, str], ...]
    params: tuple[tuple[str, str], ...]
    buffers: tuple[tuple[str, str], ...]
    collectives: tuple[CollectiveSeen, ...] = ()


@dataclass(frozen=True)
class ValueSeen:
    """A final full value against another run's (the reference, flat FSDP)."""

    fqn: str
    close: bool
    max_diff: float


@dataclass(frozen=True)
class HsdpObservation(RankRecord):
    mesh: tuple[int, ...] = ()
    step_error: str | None = None
    layout: tuple[LocalSeen, ...] = ()
    steps: tuple[StepSeen, ...] = ()
    losses: tuple[float, ...] = ()
    ref_losses: tuple[float, ...] = ()
    losses_close: bool | None = None
    ref_stable: bool = True
    vs_reference: tuple[ValueSeen, ...] = ()
    flat_error: str | None = None  # flat FSDP over the world raised
    vs_flat: tuple[ValueSeen, ...] = ()
    # flat FSDP's layout on this rank, and whether each local shard equals
    # HSDP's: bitwise at wrap time, within tolerance after training
    flat_layout: tuple[LocalSeen, ...] = ()
    flat_initial_equal: tuple[tuple[str, bool], ...] = ()
    flat_final_close: tuple[tuple[str, bool], ...] = ()
    # full state dicts: HSDP's loaded into flat FSDP and flat FSDP's into HSDP
    sd_error: str | None = None
    sd_keys: tuple[str, ...] = ()
    unsharded_keys: tuple[str, ...] = ()  # the unwrapped model's state_dict keys
    sd_to_flat_differs: tuple[str, ...] = ()
    sd_from_flat_differs: tuple[str, ...] = ()
    # a torch.distributed.checkpoint save of HSDP's sharded state dict loaded into flat FSDP
    dcp_to_flat_differs: tuple[str, ...] = ()
    # every rank built from its own seed, then synced from rank 0 on the HSDP
    # layout (FSDP2: set_model_state_dict broadcast_from_rank0; FSDP1:
    # sync_module_states): the error, the names compared, those whose full
    # value on this rank differs from rank 0's
    sync_error: str | None = None
    sync_checked: tuple[str, ...] = ()
    sync_differs: tuple[str, ...] = ()
    seconds: float = 0.0
    fsdp_seconds: float = 0.0

    @property
    def values_meaningful(self) -> bool:
        return self.backend != "fake"

    def comparable(self) -> dict:
        """What every rank must agree on: errors, state-dict keys and the
        verdicts of the full-value comparisons (local shards, digests and
        per-rank losses differ by rank by design; what a state dict brings
        back on each rank is HSDP-STATE-DICT's, which reads every rank)."""
        d = self.to_dict()
        for k in ("rank", "seconds", "fsdp_seconds", "layout", "steps", "losses", "ref_losses", "flat_layout",
                  "flat_initial_equal", "flat_final_close", "losses_close",
                  "sd_to_flat_differs", "sd_from_flat_differs", "dcp_to_flat_differs", "sync_differs"):
            d.pop(k)
        for key in ("vs_reference", "vs_flat"):
            for p in d[key]:
                p.pop("max_diff")
        # whether the sync raised, not its text: a load that fails on every
        # rank names what failed first there (rank 0 a copy, another rank the
        # key the broadcast dropped); HSDP-SYNC reports rank 0's
        d["sync_error"] = d["sync_error"] is not None
        return d
