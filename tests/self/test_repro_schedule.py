"""The training-schedule repro script builds the suite's own model: the same
initial values (seed 66's bf16 tolerance case only reproduced with them)."""

from __future__ import annotations

import pytest
import torch

from conformance.areas.schedule.repro import schedule_script
from conformance.case.build import build
from conformance.run import corpus

pytestmark = pytest.mark.selfcheck


@pytest.mark.parametrize("name", ["suite-bf16-ill-conditioned-tolerance", "fsdp1-keep-low-precision-grads-tied-param-one-shard"])
def test_the_script_starts_from_the_suite_s_values(name):
    spec = next(c.spec for c in corpus.load() if c.name == name)
    ns = {"__name__": "repro_under_test"}  # defines everything, runs nothing
    exec(compile(schedule_script(spec, [], "MP-DTYPES"), "repro.py", "exec"), ns)
    model, _ = ns["build"]()
    want = dict(build(spec).model.named_parameters())
    got = dict(model.named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert torch.equal(got[name], p), name


def _finding_cases():
    return [pytest.param(c, id=c.name) for c in corpus.load() if c.spec.schedule is not None and c.finding]


@pytest.mark.repros
@pytest.mark.parametrize("case", _finding_cases())
def test_the_script_of_each_finding_s_corpus_case_shows_it(case, tmp_path):
    """The script the suite writes for a schedule case (the repro a run
    reports) shows the corpus case's finding on two ranks: DEVIATION inside
    the finding's torch range, AS SPECIFIED outside it. Marked `repros`
    (a torchrun per case: minutes). It caught scripts that ended in a
    traceback (a raise in the gradients phase; one rank's summon left alone
    in its all-gather) or said AS SPECIFIED (a flat gradient's dtype the
    suite checks and the script did not)."""
    import sys

    from conformance.run import known, repros

    k = {f.id: f for f in known.load()}[case.finding]
    path = tmp_path / "repro.py"
    path.write_text(schedule_script(case.spec, [], case.name))
    (mode,) = [m for m in repros.modes(path) if m.ranks == 2]
    res = repros.run(path, mode, timeout=240, python=sys.executable)
    want = "DEVIATION" if known.in_range(torch.__version__, k.torch) else "AS SPECIFIED"
    assert res.returncode == 0 and res.verdict == want, f"{mode.command}: exit {res.returncode}, {res.line!r}\n{res.output[-3000:]}"
