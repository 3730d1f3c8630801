"""Rank agreement: each rank learns whether any rank failed at the same
point, before the suite's next collective (a rank that raised has left the
example): on a pool's agreement channel (conformance.engine.agree), else on
a gloo group of the suite's own; and RANKS-AGREE, every rank's observation
the same."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from conformance.case.violation import Violation
from conformance.engine import agree

_SIDE: list = []  # [the default group it was made beside, the side group]


def _side_group():
    """A gloo group beside the default one, for the suite's own agreement
    between ranks: its all-reduce never pairs up with one of FSDP's
    collectives on the default group. Created once per rank process, by every
    rank at the same point (the first schedule it runs). Keyed by the
    default group itself, held: a later one may reuse a destroyed one's address."""
    world = dist.distributed_c10d._get_default_group()
    if not _SIDE or _SIDE[0] is not world:
        _SIDE[:] = [world, dist.new_group(backend="gloo")]
    return _SIDE[1]


def any_rank_failed(failed: bool) -> bool:
    """Whether this rank or any other failed at the same point of the
    schedule. Every rank asks after each phase that can raise on some ranks
    only (a sharded parameter's gradient lives on one rank), before the
    suite's next collective: a rank that raised has left the example, and
    a collective of the suite's own would then wait for it forever."""
    if dist.get_backend() == "fake" or dist.get_world_size() == 1:
        return failed
    ch = agree.channel()
    if ch is not None:  # a pool's ranks: beside the process group (conformance.engine.agree)
        return any(ch.exchange(int(failed)))
    flag = torch.tensor([1 if failed else 0], dtype=torch.int32)
    dist.all_reduce(flag, group=_side_group())
    return bool(flag.item())


def failed_ranks(failed: bool) -> int:
    """How many ranks (this one included) failed at the same point: as
    any_rank_failed, for a caller that must tell some ranks failing from
    every rank failing."""
    if dist.get_backend() == "fake" or dist.get_world_size() == 1:
        return int(failed)
    ch = agree.channel()
    if ch is not None:
        return sum(ch.exchange(int(failed)))
    flag = torch.tensor([1 if failed else 0], dtype=torch.int32)
    dist.all_reduce(flag, group=_side_group())
    return int(flag.item())


def all_ranks_equal(value) -> bool:
    """Whether every rank holds a ``value`` equal to this rank's (a tree of
    tuples, lists, strings and numbers: compared by its repr): a 63-bit
    digest exchanged on a pool's agreement channel, elsewhere one all-reduce
    of the digest and its negation on the default group (the maximum of
    both is this rank's digest only if no rank's differs)."""
    if dist.get_backend() == "fake" or dist.get_world_size() == 1:
        return True  # one real rank: nothing to disagree with
    h = int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 1
    ch = agree.channel()
    if ch is not None:
        return all(v == h for v in ch.exchange(h))
    both = torch.tensor([h, -h], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return both.tolist() == [h, -h]


def ranks_agree(obs: list, tags: set | frozenset = frozenset()) -> list[Violation]:
    """RANKS-AGREE: every rank's observation (its comparable()) equals rank
    0's; ``tags``: the case's facts, for known failures to match on."""
    first = obs[0].comparable()
    out = []
    for o in obs[1:]:
        mine = o.comparable()
        fields = sorted(k for k in first if first[k] != mine.get(k))
        if fields:
            detail = "; ".join(f"{k}: rank {obs[0].rank} {first[k]!r} vs rank {o.rank} {mine.get(k)!r}" for k in fields)
            # the case's tags, the backend and the fields: a rank-local value verdict
            # (losses_close) that a backend's wrong collective splits is not a
            # structural disagreement
            vtags = {"kind:ranks", f"api:{obs[0].api}", *tags, *(f"differs:{k}" for k in fields)}
            if getattr(obs[0], "backend", None):
                vtags.add(f"backend:{obs[0].backend}")
            if "units" in fields and len(obs[0].units) != len(o.units):
                vtags.add("kind:units-differ")  # FSDP1: a unit one rank has and another lacks
            out.append(Violation("RANKS-AGREE", f"ranks disagree on {', '.join(fields)} ({detail[:600]})", frozenset(vtags)))
    return out
