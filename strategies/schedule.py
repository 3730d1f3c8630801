"""Strategies for training schedules (MP-DTYPES, ACCUM): a few optimizer steps
(SGD with momentum, Adam, AdamW), freeze masks that change between steps
(progressive unfreezing), microbatches that skip some submodules (or
every child of one module) with gradient sync off on all but the last (or
on every one), mixed-precision settings of either API, and sometimes a
registered method as the very first forward (FSDP2)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from conformance.areas.common.training_oracle import predict_training
from conformance.areas.schedule.oracle import used_params
from conformance.case.graph import ModelGraph
from conformance.case.spec import (
    FSDP1_STRATEGIES,
    SCHEDULE_OPTIMIZERS,
    CaseSpec,
    ForwardMethod,
    MethodStep,
    Microbatch,
    Precision,
    Schedule,
    ScheduleStep,
)
from conformance.case.tree import walk
from conformance.strategies._common import check_bool, check_int, ints, maybe, pick, pick_subset
from conformance.strategies.cases import case_specs
from conformance.strategies.groups import fsdp2_case_specs

LOW = ("bfloat16", "float16")
REDUCE = (None, "float32", "bfloat16", "float16")  # None: param_dtype's
CAST = (None, True, False)  # None: the API's default


def draw_precision(draw: Any, api: str) -> Precision:
    """Any setting either API accepts: param_dtype low or unset, reduce_dtype
    any, and the API's own fields."""
    param = pick(draw, (*LOW, None))
    reduce = pick(draw, REDUCE)
    cast = pick(draw, CAST)
    if api == "fsdp2":
        out = pick(draw, (None, "float32", *LOW))
        return Precision(param, reduce, output_dtype=out, cast_forward_inputs=cast)
    return Precision(
        param, reduce, buffer_dtype=pick(draw, (None, *LOW, "float32")), cast_forward_inputs=cast,
        cast_root_forward_inputs=not maybe(draw, 3), keep_low_precision_grads=maybe(draw, 1),
    )


def draw_schedule(draw: Any, spec: CaseSpec, *, max_steps: int, max_microbatches: int, precision: bool) -> CaseSpec:
    graph = ModelGraph(spec)
    names = [f for f, _ in graph.named_parameters()]
    initial = tuple(f for f, pid in graph.named_parameters() if not graph.requires_grad(pid))
    # FSDP1 flattens parameters when use_orig_params=False: requires_grad is
    # fixed at wrap time there
    can_change = spec.plan.api == "fsdp2" or spec.plan.use_orig_params
    skippable = [p for p, _ in walk(spec.tree) if p]  # registrations in the spec's own tree
    parents = [tuple(f"{p}.{c.name}" if p else c.name for c in m.children) for p, m in walk(spec.tree) if m.children]
    steps = []
    frozen = initial
    for i in range(1 + draw(ints(max_steps - 1))):
        if i and can_change and maybe(draw, 1):  # progressive unfreezing, or freezing more
            flip = set(pick_subset(draw, names, min_size=1, max_size=3))
            frozen = tuple(f for f in names if (f in frozen) != (f in flip))
        mbs = []
        for _ in range(1 + draw(ints(max_microbatches - 1))):
            mbs.append(Microbatch(_draw_skip(draw, skippable, parents)))
        # the synced microbatch runs backward (a loss that needs no gradient
        # has none to run), else there is nothing for FSDP to reduce in
        if mbs[-1].skip and not used_params(spec, mbs[-1].skip) - set(frozen):
            mbs[-1] = Microbatch()
        steps.append(ScheduleStep(frozen, tuple(mbs), sync_every=not maybe(draw, 2)))
    pr = draw_precision(draw, spec.plan.api) if precision and maybe(draw, 4) else None
    methods, first = (), -1
    root_drawn = spec.tree.cls in {c.name for c in spec.classes}
    taken = {x.name for x in spec.tree.params + spec.tree.buffers + spec.tree.children}
    if spec.plan.api == "fsdp2" and root_drawn and "encode" not in taken and draw(ints(2)) == 1:
        methods, first = (ForwardMethod("", "encode", (MethodStep("forward"),)),), 0
    # FSDP1: the root's ShardingStrategy, inherited by every unit without a
    # CustomWrap kwarg of its own (ZeRO-3, ZeRO-2, DDP-like)
    strategy = pick(draw, FSDP1_STRATEGIES) if spec.plan.api == "fsdp1" else "FULL_SHARD"
    sched = Schedule(tuple(steps), optimizer=pick(draw, SCHEDULE_OPTIMIZERS), precision=pr, first=first, sharding_strategy=strategy)
    event(f"schedule: {len(steps)} steps, max {max(len(s.microbatches) for s in steps)} microbatches, precision {pr.param_dtype if pr else 'none'}")
    if spec.plan.api == "fsdp1":
        event(f"schedule: fsdp1 {strategy}")
    return dataclasses.replace(spec, schedule=sched, methods=methods, calls=(), train=None)


def _draw_skip(draw: Any, skippable: list[str], parents: list[tuple[str, ...]]) -> tuple[str, ...]:
    """A microbatch's skips: half the time none; else mostly 1..2
    registrations, and a third of the time every child of one module, whose
    own forward still runs (conditional computation: an MoE layer that routes
    to none of its experts, a block whose branches are all dropped). A unit
    whose parameters all sit in such children runs without reading any of
    them: the ground of fsdp1-synced-accumulation-unused-unit-drops-grad and
    fsdp1-no-shard-unused-unit-params-unregistered. With 1..2 random
    registrations alone, 111 of 3,000 FSDP1 draws had such a unit; with
    this, 223."""
    if not skippable or not maybe(draw, 1):
        return ()
    if parents and draw(ints(2)) == 2:
        return pick(draw, parents)
    return tuple(pick_subset(draw, skippable, min_size=1, max_size=2))


@st.composite
def _schedule_specs(draw: Any, cases: SearchStrategy, max_steps: int, max_microbatches: int, precision: bool) -> CaseSpec:
    return draw_schedule(draw, draw(cases), max_steps=max_steps, max_microbatches=max_microbatches, precision=precision)


def _trainable(spec: CaseSpec) -> bool:
    """Cases the API trains at all (PARITY's own conditions: no FSDP1 frozen
    error or container unit, no FSDP2 tie split between groups)."""
    return not predict_training(spec).applicable and any(True for _ in ModelGraph(spec).named_parameters())


def schedule_specs(
    *, api: str = "fsdp2", max_modules: int = 8, max_depth: int = 3, max_steps: int = 3, max_microbatches: int = 3,
    precision: bool = True,
) -> SearchStrategy[CaseSpec]:
    """CaseSpecs with a Schedule for ``api``: the trees of :func:`case_specs`
    (frozen and tied parameters included; FSDP1 without shared modules or
    cross-unit ties, whose recorded findings corrupt its collectives), 1..
    ``max_steps`` steps of 1..``max_microbatches`` microbatches, freeze
    changes where the API allows them, and with ``precision`` usually a
    mixed-precision setting."""
    if api not in ("fsdp1", "fsdp2"):
        raise InvalidArgument(f"api={api!r} must be 'fsdp1' or 'fsdp2'")
    for name, v in (("max_modules", max_modules), ("max_steps", max_steps), ("max_microbatches", max_microbatches)):
        check_int(v, name, min_value=1)
    check_int(max_depth, "max_depth", min_value=0)
    check_bool(precision, "precision")
    if api == "fsdp2":
        cases = fsdp2_case_specs(max_modules=max_modules, max_depth=max_depth, methods=False)
    else:
        from conformance.strategies.training import fsdp1_trainable

        cases = case_specs(max_modules=max_modules, max_depth=max_depth, allow_ignored=False, allow_shared=False).filter(fsdp1_trainable)
    return _schedule_specs(cases.filter(_trainable), max_steps, max_microbatches, precision)
