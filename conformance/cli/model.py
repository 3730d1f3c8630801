"""`fsdp-conformance model TARGET`: every applicable invariant on a real
model, in this process (rank pools are closed before it exits)."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from conformance.cli.common import BACKENDS
from conformance.cli.errors import UsageError
from conformance.engine.errors import EngineError
from conformance.engine.pool import resolve_backend
from conformance.report import data, write
from conformance.run import profiles
from conformance.selfcheck import fsdp_source

if TYPE_CHECKING:
    from conformance.run.models import ModelRun

DEFAULT_REPORT_DIR = "reports/latest-model"


def add_parser(sub) -> None:
    m = sub.add_parser("model", help="check a real model: TARGET is 'package.module:attr' naming a conformance.Target")
    m.add_argument("target", metavar="TARGET")
    m.add_argument("--invariant", action="append", help="invariant ID or area (repeatable); default every one that applies")
    m.add_argument("--profile", default=None, help="dev | ci | thorough: the example budget (default: $FSDP_CONFORMANCE_PROFILE or dev)")
    m.add_argument("--examples", type=int, default=None, help="examples per invariant and tier (default: the profile's, at most 20)")
    m.add_argument("--backend", default=None, help="fake | gloo | nccl (default: fake and gloo)")
    m.add_argument("--tiers", default=None, help="several backends, comma-separated")
    m.add_argument("--world-size", type=int, default=2)
    m.add_argument("--fake-world-size", type=int, default=4)
    m.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: derandomized)")
    m.add_argument("--deadline", type=float, default=120.0, help="seconds before a pool example is a HANG")
    m.add_argument("--report-dir", default=DEFAULT_REPORT_DIR, help=f"where the report goes (default {DEFAULT_REPORT_DIR})")
    m.set_defaults(fn=cmd_model)


def _budget(profile: str | None, examples: int | None) -> int:

    try:  # an unknown profile is bad input even where --examples sets the budget
        name = profiles.selected(profile)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if examples is not None:
        if examples < 1:
            raise UsageError(f"--examples must be >= 1, got {examples}")
        return examples
    # a real model costs far more per example than a drawn tree
    return {"dev": 5, "ci": 20, "thorough": 100}[name]


def cmd_model(ns) -> int:
    # torch and the areas: imported by the commands that need them (the CLI parses, and rejects bad input, without)
    from conformance import areas as invariants
    from conformance.case.target import TargetError
    from conformance.run.models import check_model, model_invariants

    examples = _budget(ns.profile, ns.examples)
    if ns.backend and ns.tiers:
        raise UsageError("give --backend or --tiers, not both")
    tiers = [t for t in (ns.tiers or ns.backend or "fake,gloo").split(",") if t]
    bad = [t for t in tiers if t not in BACKENDS or t == "auto"]
    if bad:
        raise UsageError(f"unknown backend {bad[0]!r}; choose from fake, gloo, nccl")
    for t in tiers:  # nccl without a GPU per rank: one line, as `run` says it
        try:
            resolve_backend(t, ns.world_size)
        except EngineError as e:
            raise UsageError(str(e)) from None
    if ns.world_size < 1 or ns.fake_world_size < 1:
        raise UsageError("world sizes must be >= 1")
    try:
        model_invariants(ns.invariant)
    except invariants.UnknownInvariant as e:
        raise UsageError(str(e)) from None
    report_dir = Path(ns.report_dir).resolve()
    # the target is the user's code, importable from where they run us (as
    # `python -m` and pytest would); rank pools inherit this sys.path
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    counted: Counter = Counter()
    try:
        with counting_warnings(counted):  # torch's warnings: counted into the report, not thousands of stderr lines
            run = check_model(
                ns.target, invariants=ns.invariant, tiers=tuple(tiers), examples=examples, seed=ns.seed,
                world_size=ns.world_size, fake_world_size=ns.fake_world_size, deadline=ns.deadline,
                repro_dir=report_dir / "repros", progress=lambda line: print(line, flush=True),
            )
    except TargetError as e:
        raise UsageError(str(e)) from None

    info = [{"tier": t, "backend": t, "world_size": ns.fake_world_size if t == "fake" else ns.world_size} for t in tiers]
    rep = model_report(run, info, ns.invariant, profile=ns.profile or os.environ.get("FSDP_CONFORMANCE_PROFILE") or "dev", seed=ns.seed,
                       examples=examples, started_at=started)
    rep["torch_warnings"] = [{"category": c, "message": m, "where": w, "count": n} for (c, m, w), n in counted.most_common()]
    write.write_all(rep, report_dir)
    print(run.summary())
    if counted:
        top = counted.most_common(1)[0]
        print(f"warnings: {sum(counted.values())} ({len(counted)} distinct; the most frequent, {top[1]}x: {top[0][0]}: {top[0][1][:100]})"
              " in report.json torch_warnings")
    print(f"report: {report_dir / 'report.json'} (+ summary.md, junit.xml, report.html)")
    return 0 if run.ok and not rep["summary"]["failed"] else 1


@contextlib.contextmanager
def counting_warnings(counts: Counter):
    """Every warning raised in the block counted by (category, first line,
    file:line) instead of printed (an adapter's own catch_warnings still
    records what it checks)."""
    def count(message, category, filename, lineno, file=None, line=None):
        counts[(category.__name__, str(message).strip().splitlines()[0][:300] if str(message).strip() else "", f"{filename}:{lineno}")] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = count
        yield counts


def model_report(run: ModelRun, tiers_info: list[dict], selection: list[str] | None = None, *, profile: str | None = None,
                 seed: int | None = None, examples: int | None = None, started_at: str | None = None) -> dict:
    """The report dict (same schema and rows as `fsdp-conformance run`'s)."""

    selected = sorted({inv for inv, _ in run.checked} | {s["invariant"] for s in run.skipped})  # a SKIP was selected: its row says why
    return data.build(
        fsdp_source=fsdp_source.report_info(),
        partials=[run.session.to_dict()],
        tests=run.skip_records(),  # the invariants not checked on a model, with the reason
        run={"tiers": tiers_info, "target": run.target, "selection": selection or selected, "selected": selected,
             "profile": profile, "seed": seed, "examples": examples},
        status="complete",
        started_at=started_at,
        finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        wall_seconds=run.seconds,
    )
