"""What one rank saw while running a training schedule (MP-DTYPES, ACCUM):
dtypes inside forward and in the gradient reduction, gradients and
parameters against single-process training. Pure data."""

from __future__ import annotations

from dataclasses import dataclass

from conformance.areas.common.observation import RankRecord


@dataclass(frozen=True)
class ForwardSeen:
    """The first forward of ``path`` in step ``step``: the dtypes of its
    floating inputs, own parameters (name, dtype) and buffers (name, dtype)."""

    step: int
    path: str
    inputs: tuple[str, ...]
    params: tuple[tuple[str, str], ...]
    buffers: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class MicrobatchSeen:
    """One microbatch: the reduce collectives its backward issued (op, dtype),
    whether gradient sync was on, and its loss against the reference's."""

    step: int
    index: int
    synced: bool
    reduces: tuple[tuple[str, str], ...]
    output_dtype: str
    loss_err: float
    emulated_loss_err: float | None = None  # against the emulated pipeline's (MP-PIPELINE; None: not emulated)
    # where FSDP promises no cast of the root's forward inputs: the dtypes of
    # the floating inputs the test fed the model and of those FSDP handed the
    # root's forward (seen by the user's own cast after FSDP's pre-forward;
    # None: not recorded, FSDP casts there or a registered method ran)
    fed: tuple[str, ...] | None = None
    handed: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ValueSeen:
    """A parameter's gradient (before the step) or value (after it) at one
    step: its dtype, whether it is None here and in the reference, and the
    error relative to 1 + max |reference| (None: not comparable)."""

    step: int
    fqn: str
    dtype: str | None
    none: bool
    ref_none: bool
    err: float | None
    unchanged: bool | None = None  # value equals the step's starting value
    emulated_err: float | None = None  # a gradient's error against the emulated pipeline's (MP-PIPELINE; None: not emulated)


@dataclass(frozen=True)
class ScheduleObservation(RankRecord):
    step_error: str | None = None  # "step S microbatch M: Type: message"
    # where this rank stopped because another rank failed there (it raised
    # nothing itself): the ranks then disagree on step_error or wrap_error
    peer_failed: str | None = None
    # per step: the largest error (relative, as ``err``) of the reference
    # computed in the compute dtype against the fp32 reference, over its
    # losses and gradients: what rounding alone does to this case there
    rounding_noise: tuple[float, ...] = ()
    # the steps whose promised pipeline leaves the range of its dtypes: the
    # emulated pipeline's gradients or losses are not finite there, or (not
    # emulated) a reference gradient's magnitude exceeds reduce_dtype's
    # largest value (float16: 65504), so that the promised mean reduced in
    # it cannot be finite. fp32 training is no bound for such a step.
    overflow_steps: tuple[int, ...] = ()
    forwards: tuple[ForwardSeen, ...] = ()
    microbatches: tuple[MicrobatchSeen, ...] = ()
    grads: tuple[ValueSeen, ...] = ()  # () where FSDP exposes no per-parameter gradient
    params: tuple[ValueSeen, ...] = ()
    buffers_after: tuple[tuple[str, str], ...] = ()
    seconds: float = 0.0
    fsdp_seconds: float = 0.0  # wrapping, the FSDP model's microbatches and optimizer steps, reading its full values and gradients (the references excluded)
    emulation_error: str | None = None  # the emulated pipeline (MP-PIPELINE) itself failed here

    def comparable(self) -> dict:
        """What every rank must agree on (errors differ by rank's data)."""
        d = self.to_dict()
        for k in ("rank", "seconds", "fsdp_seconds", "peer_failed", "rounding_noise", "overflow_steps", "emulation_error"):
            d.pop(k)
        for mb in d["microbatches"]:
            mb.pop("loss_err")
            mb.pop("emulated_loss_err")
        for v in d["grads"] + d["params"]:
            v.pop("err")
            v.pop("emulated_err")
            # FSDP1's sharded views: a rank whose shard is empty has no .grad
            # (checked per rank by the invariants)
            v.pop("none")
            v.pop("dtype")
        return d
