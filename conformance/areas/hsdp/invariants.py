"""HSDP-PARITY, HSDP-REPLICAS, HSDP-DEGENERATE, HSDP-LAYOUT,
HSDP-STATE-DICT, HSDP-COMMS: FSDP2 over a 2-D (replicate, shard) mesh and
FSDP1's hybrid strategies, against single-process training, flat FSDP over
the whole world and the oracle (conformance.areas.hsdp.oracle)."""

from __future__ import annotations

import math
from collections import Counter

from conformance.areas.common.catalog import VALUES_UNCHECKED, Catalog, NotChecked
from conformance.areas.common.fsdp2_oracle import container_given_to_fully_shard, fsdp2_case_tags
from conformance.areas.common.violations import backend_tag, fsdp1_cause_tags, load_cause_tag, tie_within_one_module, violation
from conformance.areas.hsdp.observation import HsdpObservation
from conformance.areas.hsdp.oracle import PLACEMENTS_2D, HsdpPrediction, local_shape
from conformance.case.spec import CaseSpec
from conformance.case.violation import Violation

catalog = Catalog()

DOC_FULLY_SHARD = "fully_shard docstring (mesh: a 2-D mesh (replicate, shard) gives HSDP: sharded across dim 1, replicated across dim 0)"
DOC_STRATEGY = ("ShardingStrategy docstring (HYBRID_SHARD: \"Apply FULL_SHARD within a node, and replicate parameters across nodes\"; "
                "_HYBRID_SHARD_ZERO2: SHARD_GRAD_OP within a node); FullyShardedDataParallel docstring (process_group: a tuple "
                "(shard group, replicate group) for hybrid strategies; device_mesh: a 2-D mesh)")
UPSTREAM = ("test/distributed/_composable/fsdp/test_fully_shard_training.py (TestFullyShardHSDPTraining); "
            "test/distributed/fsdp/test_fsdp_hybrid_shard.py")


def case_tags(spec: CaseSpec, pred: HsdpPrediction, obs: HsdpObservation) -> set[str]:
    h = spec.hsdp
    tags = {f"api:{spec.plan.api}", pred.mesh_tag(), f"way:{h.way}", backend_tag(obs), f"optim:{h.optimizer}"}
    if spec.plan.api == "fsdp1":
        tags |= {f"strategy:{h.strategy}", f"uop:{str(spec.plan.use_orig_params).lower()}"}
    elif container_given_to_fully_shard(spec):
        tags.add("container-subclass")  # a ModuleList/ModuleDict subclass with a forward, given to fully_shard
    if pred.training.frozen:
        tags.add("frozen")
    if spec.ties:
        tags.add("tie")
    if tie_within_one_module(spec):
        tags.add("tie:same-module")  # one module holds a Parameter under two of its names
    if spec.shared:
        tags.add("shared-module")
    if pred.training.fsdp2 is not None:
        # the FSDP2 list-group facts FSDP2's own findings match on (a group
        # whose last module's output needs no gradient), mesh or not
        tags |= {t for t in fsdp2_case_tags(spec, pred.training.fsdp2) if t.startswith("group:multi-frozen-embedding")}
    return tags


def _raised(spec, pred, obs_list) -> NotChecked | None:
    """NotChecked where training is not promised or FSDP raised (HSDP-PARITY reports the raise)."""
    if pred.applicable:
        return NotChecked(f"training is not promised for this case: {pred.applicable}")
    first = obs_list[0]
    if first.wrap_error or first.step_error:
        return NotChecked(f"FSDP raised (HSDP-PARITY reports it): {first.wrap_error or first.step_error}")
    return None


@catalog.invariant(
    "HSDP-PARITY",
    group="hsdp",
    api="fsdp1|fsdp2",
    scenario="hsdp",
    all_ranks=True,
    statement="A few optimizer steps (SGD, Adam) over a (replicate, shard) layout (FSDP2 fully_shard(mesh=2-D mesh); FSDP1 HYBRID_SHARD or _HYBRID_SHARD_ZERO2 given device_mesh or process_group=(shard group, replicate group)), on data that differs by rank, match single-process training on the mean loss (every rank's losses, the final full parameters) and flat FSDP over the whole world (the final full parameters), within the training tolerance; (2, 2), (4, 1), (1, 4) on 4 ranks, (2, 1), (1, 2) on 2.",
    source=f"{DOC_FULLY_SHARD}; {DOC_STRATEGY}; {UPSTREAM} (HSDP training equals DDP's / single process)",
)
def check_parity(spec: CaseSpec, pred: HsdpPrediction, obs: list[HsdpObservation]) -> list[Violation] | NotChecked:
    if pred.applicable:
        return NotChecked(f"training is not promised for this case: {pred.applicable}")
    first = obs[0]
    tags = case_tags(spec, pred, first)
    if first.wrap_error or first.step_error:
        where, err = own_error(obs, "wrap_error") or own_error(obs, "step_error")
        freed = {"error:freed-storage"} if "out of bounds for storage of size 0" in err else set()  # a parameter over freed storage
        raised = {f"raised:{err.split(':', 1)[0]}"} if not err.startswith("another rank") else set()  # the exception type
        return [violation("HSDP-PARITY", f"HSDP raised{where} {err}", tags, "kind:raised", *freed, *raised, *fsdp1_cause_tags(err))]
    if not first.values_meaningful:
        return VALUES_UNCHECKED
    if not first.ref_stable:
        return NotChecked("the single-process reference diverged: its values are not comparable")
    out = []
    for o in obs:
        if o.losses_close is False:
            out.append(violation("HSDP-PARITY", f"rank {o.rank}: losses {list(o.losses)} differ from single-process {list(o.ref_losses)}",
                                 tags, "kind:loss"))
    for p in first.vs_reference:
        if not p.close:
            out.append(violation("HSDP-PARITY", f"{p.fqn} after training differs from single-process by {p.max_diff:.3g}", tags, "kind:param"))
    if first.flat_error:
        out.append(violation("HSDP-PARITY", f"flat FSDP over the world raised {first.flat_error}", tags, "kind:flat-raised"))
    for p in first.vs_flat:
        if not p.close:
            out.append(violation("HSDP-PARITY", f"{p.fqn} after training differs from flat FSDP's by {p.max_diff:.3g}", tags, "kind:flat"))
    return out


def _by_shard(pred: HsdpPrediction, obs: list[HsdpObservation]) -> dict[int, list[HsdpObservation]]:
    out: dict[int, list[HsdpObservation]] = {}
    for o in sorted(obs, key=lambda o: o.rank):
        out.setdefault(pred.shard_index(o.rank), []).append(o)
    return out


@catalog.invariant(
    "HSDP-REPLICAS",
    group="hsdp",
    api="fsdp1|fsdp2",
    scenario="hsdp",
    all_ranks=True,
    statement="After every step, ranks in the same shard position of different replica groups hold bit-identical local gradients (after backward), parameters (after the optimizer step) and buffers, though each rank trained on its own data (the replicate dim's all-reduce makes the replicas one).",
    source=f"{DOC_STRATEGY}; {DOC_FULLY_SHARD}; {UPSTREAM} (test_fsdp_hybrid_shard: the inter-node all-reduce)",
)
def check_replicas(spec: CaseSpec, pred: HsdpPrediction, obs: list[HsdpObservation]) -> list[Violation] | NotChecked:
    skip = _raised(spec, pred, obs)
    if skip is not None:
        return skip
    if pred.replicate == 1:
        return NotChecked("one replica: nothing to be identical with")
    if not obs[0].values_meaningful:
        return VALUES_UNCHECKED
    tags = case_tags(spec, pred, obs[0])
    out = []
    for index, group in _by_shard(pred, obs).items():
        first = group[0]
        for o in group[1:]:
            for k, (a, b) in enumerate(zip(first.steps, o.steps)):
                for what in ("grads", "params", "buffers"):
                    mine, theirs = dict(getattr(a, what)), dict(getattr(b, what))
                    bad = sorted(n for n in set(mine) | set(theirs) if mine.get(n) != theirs.get(n))
                    if bad:
                        out.append(violation("HSDP-REPLICAS", f"step {k}: shard {index}'s replicas (ranks {first.rank}, {o.rank}) hold different "
                                             f"{what[:-1]} {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}", tags, f"kind:replica-{what[:-1]}"))
    return out


@catalog.invariant(
    "HSDP-DEGENERATE",
    group="hsdp",
    api="fsdp1|fsdp2",
    scenario="hsdp",
    all_ranks=True,
    statement="A (n, 1) layout behaves like DDP: every rank holds every parameter in full and, after each backward, every rank's gradients are bit-identical (all-reduced over all n ranks); a (1, n) layout behaves like flat FSDP over the same ranks: the same local shard shapes, bit-identical local shards at wrap time and, after training, local shards equal within the training tolerance (while the single-process reference stays finite).",
    source=f"{DOC_FULLY_SHARD}; {DOC_STRATEGY}; {UPSTREAM}",
)
def check_degenerate(spec: CaseSpec, pred: HsdpPrediction, obs: list[HsdpObservation]) -> list[Violation] | NotChecked:
    r, s = pred.mesh
    if r > 1 and s > 1:
        return NotChecked(f"mesh {pred.mesh} is not degenerate")
    skip = _raised(spec, pred, obs)
    if skip is not None:
        return skip
    tags = case_tags(spec, pred, obs[0])
    out = []
    if s == 1:
        for o in obs:
            for seen in o.layout:
                if math.prod(seen.local_shape) < math.prod(seen.full_shape):
                    out.append(violation("HSDP-DEGENERATE", f"rank {o.rank} holds {seen.name} as {seen.local_shape}, not in full {seen.full_shape}",
                                         tags, "kind:not-full"))
        if not obs[0].values_meaningful:
            return out  # the layout was compared; the gradients carry no values here
        first = obs[0]
        for o in obs[1:]:
            for k, (a, b) in enumerate(zip(first.steps, o.steps)):
                mine, theirs = dict(a.grads), dict(b.grads)
                bad = sorted(n for n in set(mine) | set(theirs) if mine.get(n) != theirs.get(n))
                if bad:
                    out.append(violation("HSDP-DEGENERATE", f"step {k}: ranks {first.rank} and {o.rank} hold different gradients of "
                                         f"{', '.join(bad[:4])} (a DDP-like layout all-reduces them)", tags, "kind:grads-not-all-reduced"))
        return out
    if not obs[0].values_meaningful:
        return VALUES_UNCHECKED
    if obs[0].flat_error:
        return NotChecked(f"flat FSDP raised (HSDP-PARITY reports it): {obs[0].flat_error}")
    for o in obs:
        mine = {x.name: x.local_shape for x in o.layout}
        flat = {x.name: x.local_shape for x in o.flat_layout}
        if mine != flat:
            bad = sorted(n for n in set(mine) | set(flat) if mine.get(n) != flat.get(n))
            out.append(violation("HSDP-DEGENERATE", f"rank {o.rank}: local shards of {', '.join(bad[:4])} are {[mine.get(n) for n in bad[:4]]}, "
                                 f"flat FSDP's {[flat.get(n) for n in bad[:4]]}", tags, "kind:shard-shape"))
        bad = [n for n, ok in o.flat_initial_equal if not ok]
        if bad:
            out.append(violation("HSDP-DEGENERATE", f"rank {o.rank}: at wrap time the local shards of {', '.join(bad[:4])} differ from flat FSDP's",
                                 tags, "kind:initial-shard"))
        bad = [n for n, ok in o.flat_final_close if not ok]
        if bad and o.ref_stable:  # a diverged run's values are not comparable within a tolerance
            out.append(violation("HSDP-DEGENERATE", f"rank {o.rank}: after training the local shards of {', '.join(bad[:4])} differ from flat FSDP's",
                                 tags, "kind:final-shard"))
    return out


@catalog.invariant(
    "HSDP-LAYOUT",
    group="hsdp",
    api="fsdp1|fsdp2",
    scenario="hsdp",
    all_ranks=True,
    statement="FSDP2 over a 2-D mesh: every parameter is a DTensor on the (replicate, shard) mesh with placements (Replicate(), Shard(dim=0)), each rank holding torch.chunk's piece of dim 0 for its shard index; FSDP1's hybrid strategies: each unit's flat parameter holds its parameters' numel, sharded over the shard dim only (each rank ceil(numel / shard) elements, padding undocumented with use_orig_params=True: at least that many).",
    source=f"{DOC_FULLY_SHARD}; {DOC_STRATEGY}",
)
def check_layout(spec: CaseSpec, pred: HsdpPrediction, obs: list[HsdpObservation]) -> list[Violation] | NotChecked:
    if obs[0].wrap_error:
        return NotChecked(f"FSDP raised at wrap (HSDP-PARITY reports it): {obs[0].wrap_error}")
    tags = case_tags(spec, pred, obs[0])
    r, s = pred.mesh
    out = []
    for o in obs:
        j = pred.shard_index(o.rank)
        seen = {x.name: x for x in o.layout}
        if pred.api == "fsdp2":
            for fqn, shape, _ in pred.shapes:
                x = seen.get(fqn)
                if x is None:
                    out.append(violation("HSDP-LAYOUT", f"rank {o.rank}: {fqn} is not among the sharded model's parameters", tags, "kind:missing"))
                    continue
                if x.placements != PLACEMENTS_2D or tuple(x.mesh_shape) != (r, s):
                    out.append(violation("HSDP-LAYOUT", f"rank {o.rank}: {fqn} is {x.placements or 'a plain tensor'} on a mesh of "
                                         f"{tuple(x.mesh_shape)}, promised {PLACEMENTS_2D} on {(r, s)}", tags, "kind:placements"))
                want = local_shape(shape, s, j)
                if tuple(x.local_shape) != want:
                    out.append(violation("HSDP-LAYOUT", f"rank {o.rank} (shard {j}): local shard of {fqn} {tuple(x.local_shape)}, promised {want}",
                                         tags, "kind:local-shape"))
            continue
        units = dict(pred.unit_numel)
        got = {x.name.removeprefix("unit:"): x for x in o.layout}
        if set(got) != set(units):
            out.append(violation("HSDP-LAYOUT", f"rank {o.rank}: flat parameters of units {sorted(got)}, promised {sorted(units)}", tags, "kind:units"))
            continue
        for path, n in units.items():
            local = math.prod(got[path].local_shape)
            want = math.ceil(n / s)
            ok = local == want if pred.exact_numel else local >= want
            if not ok:
                out.append(violation("HSDP-LAYOUT", f"rank {o.rank}: unit {path or '<root>'} holds {local} elements of its {n}, promised "
                                     f"{'' if pred.exact_numel else 'at least '}{want} (sharded over {s} ranks)", tags, "kind:local-numel"))
    return out


@catalog.invariant(
    "HSDP-STATE-DICT",
    group="hsdp",
    api="fsdp1|fsdp2",
    scenario="hsdp",
    all_ranks=True,
    statement="A full state dict (torch.distributed.checkpoint.state_dict get_model_state_dict / set_model_state_dict, full_state_dict=True) of the trained HSDP model has the unwrapped model's keys, loads into flat FSDP over the whole world and comes back with equal values; flat FSDP's loads into HSDP the same way; a torch.distributed.checkpoint save of HSDP's sharded state dict loads into flat FSDP with equal values.",
    source="torch.distributed.checkpoint.state_dict docstrings (get_model_state_dict / set_model_state_dict, StateDictOptions.full_state_dict); "
           "torch.distributed.checkpoint save / load docstrings (load-time resharding); "
           f"{DOC_FULLY_SHARD}; {DOC_STRATEGY}",
)
def check_state_dict(spec: CaseSpec, pred: HsdpPrediction, obs: list[HsdpObservation]) -> list[Violation] | NotChecked:
    skip = _raised(spec, pred, obs)
    if skip is not None:
        return skip
    first = obs[0]
    if not first.values_meaningful:
        return VALUES_UNCHECKED
    if first.flat_error:
        return NotChecked(f"flat FSDP raised (HSDP-PARITY reports it): {first.flat_error}")
    if not first.unsharded_keys:
        return NotChecked("the model has no parameters or buffers: no state dict to carry")
    tags = case_tags(spec, pred, first)
    if first.sd_error:
        return [violation("HSDP-STATE-DICT", f"the state dict round trip raised {first.sd_error}", tags, "kind:state-dict-raised")]
    out = []
    if first.sd_keys != first.unsharded_keys:
        missing, extra = sorted(set(first.unsharded_keys) - set(first.sd_keys)), sorted(set(first.sd_keys) - set(first.unsharded_keys))
        out.append(violation("HSDP-STATE-DICT", f"HSDP's full state dict keys differ from the unwrapped model's (missing {missing}, extra {extra})",
                             tags, "kind:keys"))
    for o in obs:
        if o.sd_to_flat_differs:
            out.append(violation("HSDP-STATE-DICT", f"rank {o.rank}: HSDP's full state dict loaded into flat FSDP comes back different at "
                                 f"{list(o.sd_to_flat_differs)}", tags, "kind:to-flat"))
        if o.sd_from_flat_differs:
            out.append(violation("HSDP-STATE-DICT", f"rank {o.rank}: flat FSDP's full state dict loaded into HSDP comes back different at "
                                 f"{list(o.sd_from_flat_differs)}", tags, "kind:from-flat"))
        if o.dcp_to_flat_differs:
            out.append(violation("HSDP-STATE-DICT", f"rank {o.rank}: HSDP's torch.distributed.checkpoint save loaded into flat FSDP differs at "
                                 f"{list(o.dcp_to_flat_differs)}", tags, "kind:dcp-to-flat"))
    return out


@catalog.invariant(
    "HSDP-COMMS",
    group="hsdp",
    api="fsdp1|fsdp2",
    scenario="hsdp",
    all_ranks=True,
    statement="Each step, on every rank, each FSDP2 parameter group or FSDP1 unit with a trainable parameter reduces its gradient once in backward: a reduce-scatter over the shard dim's ranks (none when the shard dim has one rank) and an all-reduce of the shard over the replicate dim's ranks (where it has more than one), of the oracle's numel; every all-gather spans the shard dim (none on a one-rank shard dim); no other reduction.",
    source=f"{DOC_FULLY_SHARD}; {DOC_STRATEGY}; {UPSTREAM} (test_fsdp_hybrid_shard patches all_reduce and counts it over the inter-node group); "
           "test_fully_shard_comm.py (counts per group)",
)
def check_comms(spec: CaseSpec, pred: HsdpPrediction, obs: list[HsdpObservation]) -> list[Violation] | NotChecked:
    skip = _raised(spec, pred, obs)
    if skip is not None:
        return skip
    tags = case_tags(spec, pred, obs[0])
    r, s = pred.mesh
    want_count = Counter((x.op, x.ranks) for x in pred.reductions)
    want_numel = sorted((x.op, x.ranks, x.numel) for x in pred.reductions)
    out = []
    for o in obs:
        for k, step in enumerate(o.steps):
            where = f"rank {o.rank} step {k}"
            gathers = [c for c in step.collectives if c.op == "all_gather"]
            if s == 1 and gathers:
                out.append(violation("HSDP-COMMS", f"{where}: {len(gathers)} all-gathers on a one-rank shard dim", tags, "kind:extra", "op:all_gather"))
            elif any(c.ranks != s for c in gathers):
                out.append(violation("HSDP-COMMS", f"{where}: all-gathers over {sorted({c.ranks for c in gathers})} ranks, promised {s} (the shard dim)",
                                     tags, "kind:ranks", "op:all_gather"))
            # a one-rank all-reduce over a one-rank replicate dim changes nothing: not counted
            reductions = [c for c in step.collectives if c.op in ("reduce_scatter", "all_reduce")
                          and not (c.op == "all_reduce" and c.ranks == 1 and r == 1)]
            got_count = Counter((c.op, c.ranks) for c in reductions if c.phase == "backward")
            early = [c for c in reductions if c.phase != "backward"]
            if early:
                out.append(violation("HSDP-COMMS", f"{where}: {len(early)} reductions in forward", tags, "kind:extra", "phase:forward"))
            if got_count != want_count:
                for op, ranks in sorted(set(got_count) | set(want_count)):
                    g, w = got_count[(op, ranks)], want_count[(op, ranks)]
                    if g != w:
                        out.append(violation("HSDP-COMMS", f"{where}: {g} {op} over {ranks} ranks in backward, promised {w} (mesh {pred.mesh})",
                                             tags, "kind:extra" if g > w else "kind:missing", f"op:{op}", f"ranks:{ranks}"))
                continue
            if pred.exact_numel:
                got_numel = sorted((c.op, c.ranks, c.numel) for c in reductions)
                if got_numel != want_numel:
                    out.append(violation("HSDP-COMMS", f"{where}: reductions of {got_numel}, promised {want_numel}", tags, "kind:numel"))
    return out


def own_error(obs: list[HsdpObservation], field: str) -> tuple[str, str] | None:
    """A step's error as the rank that raised it says it: rank 0 may only
    have seen that another rank raised ("another rank's sync raised"), which
    names no mechanism. (" on rank N" where that rank is not rank 0, the
    error) of the first rank whose own call raised, else of the first that
    saw an error; None if none did."""
    errs = [(o.rank, getattr(o, field)) for o in obs if getattr(o, field)]
    own = [(r, e) for r, e in errs if not e.startswith("another rank")] or errs
    if not own:
        return None
    rank, err = own[0]
    return ("" if rank == 0 or err.startswith("another rank") else f" on rank {rank}"), err


def sync_error_tag(text: str) -> str:
    """The mechanism of a sync's error, for findings to match on."""
    if "requires them to be on GPU" in text:
        return "error:sync-needs-gpu"
    return load_cause_tag(text) or "error:other"


DOC_SYNC = ("FullyShardedDataParallel docstring (sync_module_states: 'each FSDP module will broadcast module parameters and "
            "buffers from rank 0 to ensure that they are replicated across ranks'); torch.distributed.checkpoint.state_dict "
            "StateDictOptions (broadcast_from_rank0: 'rank0 should receive a full state_dict and will broadcast the tensors "
            "in the state_dict/optim_state_dict one by one to other ranks') and set_model_state_dict docstrings")


@catalog.invariant(
    "HSDP-SYNC",
    group="hsdp",
    api="fsdp1|fsdp2",
    scenario="hsdp",
    all_ranks=True,
    statement="Every rank built from its own seed, the HSDP layout synced from rank 0 (FSDP2: set_model_state_dict of rank 0's full state dict with broadcast_from_rank0=True on the 2-D mesh; FSDP1: sync_module_states=True) leaves every rank of every replica with rank 0's parameters and persistent buffers (every module's: the root's, a unit's and the modules' under a unit), bit for bit; FSDP1 with rank 0's non-persistent buffers too; FSDP2's non-persistent buffers are outside a state dict and not compared.",
    source=f"{DOC_SYNC}; {DOC_FULLY_SHARD}; {DOC_STRATEGY}",
)
def check_sync(spec: CaseSpec, pred: HsdpPrediction, obs: list[HsdpObservation]) -> list[Violation] | NotChecked:
    skip = _raised(spec, pred, obs)
    if skip is not None:
        return skip
    first = obs[0]
    if not first.values_meaningful:
        return VALUES_UNCHECKED
    if first.flat_error:
        return NotChecked(f"flat FSDP raised before the sync ran (HSDP-PARITY reports it): {first.flat_error}")
    tags = case_tags(spec, pred, first) | {"at:sync"}
    if first.sync_error:
        where, err = own_error(obs, "sync_error")
        return [violation("HSDP-SYNC", f"the sync from rank 0 raised{where} {err}", tags, "kind:raised", sync_error_tag(err))]
    if not first.sync_checked:
        return NotChecked("the model has no parameters or buffers to sync")
    params = {f for f, _, _ in pred.shapes}
    out = []
    for o in obs:
        if o.sync_differs:
            what = "sync:buffer" if any(n not in params for n in o.sync_differs) else "sync:param"
            out.append(violation("HSDP-SYNC", f"rank {o.rank} (replica {o.rank // pred.shard}): after the sync from rank 0, "
                                 f"{list(o.sync_differs)[:6]} differ from rank 0's", tags, "kind:not-synced", what))
    return out


INVARIANTS = tuple(catalog.invariants)
