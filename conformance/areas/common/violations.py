"""Violations as the invariants make them: one factory (the invariant, the
message, the case's tags and the kind of disagreement), and the tags every
value invariant adds."""

from __future__ import annotations

import re

from conformance.case.violation import Violation

# the exception a "raised" violation names ("call 2 raised RuntimeError: ..."),
# as a tag: a known failure that raises one error must not absorb another
_RAISED = re.compile(r"\b([A-Z][A-Za-z0-9_]*(?:Error|Exception|Warning|Interrupt|Exit))\b")
RAISING_KINDS = ("kind:raised", "kind:backward-raised", "kind:state-dict-raised", "kind:unclear-rejection", "kind:unclear-error")


def backend_tag(obs) -> str:
    """The process group's backend, for the invariants that compare values with
    the reference (PARITY, MP-DTYPES, ACCUM, FSDP2-FROZEN, FWD-PARITY, FWD-ISOLATION): a known failure
    of one backend's collectives must not mask the others'."""
    return f"backend:{obs.backend}"


def raised_tags(msg: str, tags: set[str]) -> set[str]:
    """raised:<ExceptionType> for a violation of a raising kind whose message
    names the exception."""
    if not any(k in tags for k in RAISING_KINDS):
        return set()
    m = _RAISED.search(msg)
    return {f"raised:{m.group(1)}"} if m else set()


def violation(inv: str, msg: str, tags: set[str], *extra: str) -> Violation:
    tags = set(tags) | set(extra)
    return Violation(inv, msg, frozenset(tags | raised_tags(msg, tags)))


def fsdp1_cause_tags(error: str) -> set[str]:
    """Which FSDP1 internal failure an error message is, where the message
    alone tells: ``cause:shared-param-not-parameter`` for FSDP1 re-registering
    a shared (tied) parameter whose primary was left a plain Tensor view
    (``_use_unsharded_views``: "as_params=True type(prim_param)=...")."""
    if "as_params=True type(prim_param)=" in error:
        return {"cause:shared-param-not-parameter"}
    return set()


def freed_storage_tags(error: str) -> set[str]:
    """``error:freed-storage`` for a parameter read over its unsharded storage
    after FSDP freed it ("setStorage: ... out of bounds for storage of size
    0"), ``error:data-not-allocated`` for a freed (resized to 0) unsharded
    parameter used as it is ("The tensor has a non-zero number of elements,
    but its data is not allocated yet": a LayerNorm's backward): the errors
    of fsdp2-frozen-list-group-freed-in-backward, which its rules name so
    that a different raise with the same tags is a FAIL."""
    if "out of bounds for storage of size 0" in error:
        return {"error:freed-storage"}
    if "its data is not allocated yet" in error:
        return {"error:data-not-allocated"}
    return set()


def tie_within_one_module(spec) -> bool:
    """Whether one module holds a Parameter under two of its names: a tie
    beside its source in the source's own module, or two aliases on one
    module (the root's tied0 and tied1 of proj0.weight). The tag
    "tie:same-module" (DCP's state-dict walk dedups such a module's names)."""
    aliases: dict[str, set[str]] = {}
    for t in spec.ties:
        aliases.setdefault(t.source, {t.source}).add(f"{t.module}.{t.name}" if t.module else t.name)
    return any(len({n.rpartition(".")[0] for n in group}) < len(group) for group in aliases.values())


def load_cause_tag(text: str) -> str | None:
    """The cause of a failed load_state_dict / set_model_state_dict, as the
    error's text keeps it (fsdp2_adapter.load_cause), as a tag for findings
    to match on; None: not one of these."""
    if "mixed torch.Tensor and DTensor" in text:
        return "error:mixed-tensor-dtensor"
    if "in-place operations that require placement changes are not supported" in text:
        return "error:placement-change"  # the same copy into a one-element parameter
    if "Missing key(s) in state_dict" in text:
        return "error:missing-key"  # broadcast_from_rank0: a rank other than 0 has no target for a key rank 0 sent
    return None
