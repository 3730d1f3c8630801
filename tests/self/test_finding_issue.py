"""`fsdp-conformance finding ID`: a finding as a GitHub issue body that an
FSDP maintainer can act on (issue 19: title, what happens and what was
promised, the repro and its output on the installed torch, the affected
releases, collect_env, the upstream links), Markdown or JSON; bad input is one line."""

from __future__ import annotations

import json
import re

import pytest

from conformance.run import known
from tests.self.test_cli import assert_one_line_error, cli

pytestmark = pytest.mark.selfcheck

# a finding whose repro is quick in both its modes (a shown one and a not-shown one)
FID = "fsdp2-clip-inf-norm-empty-local-shard"


def test_every_finding_has_an_issue_title_naming_its_api():
    # TP: a tensor-parallel deviation that reproduces without FSDP (parallelize_module alone)
    for k in known.load():
        assert re.match(r"^\[(FSDP1|FSDP2|DCP|TP|nn\.Module)\] \S", k.title) and len(k.title) <= 130, (k.id, k.title)


def test_finding_lists_every_finding_without_an_id(cli_in_process):
    proc = cli_in_process("finding")
    assert proc.returncode == 0, proc.stderr
    ids = [ln.split()[0] for ln in proc.stdout.splitlines()]
    assert ids == [k.id for k in known.load()]


def test_an_unknown_finding_is_one_line_with_the_nearest_ids(cli_in_process):
    assert_one_line_error(cli_in_process("finding", "fsdp2-clip-inf-norm"), f"did you mean {FID}")
    assert_one_line_error(cli_in_process("finding", FID, "--format", "yaml"), "invalid choice")


def test_the_issue_body_runs_the_repro_in_every_mode_and_says_what_each_showed():
    proc = cli("finding", FID, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    k = next(k for k in known.load() if k.id == FID)
    assert d["title"] == k.title and d["class"] == "bug" and d["promise"]["evidence"] == k.evidence
    assert d["root_cause"]["id"] == k.root_cause.id and d["repro"]["script"].startswith('"""')
    by_cmd = {r["command"]: r for r in d["repro"]["runs"]}
    assert set(by_cmd) == {f"torchrun --nproc-per-node 2 {FID}.py", f"python {FID}.py"}
    shown, not_shown = by_cmd[f"torchrun --nproc-per-node 2 {FID}.py"], by_cmd[f"python {FID}.py"]
    # the installed torch is inside the finding's range in this checkout's CI: the shown mode shows it
    assert d["affected"]["installed_in_range"] is known.in_range(d["affected"]["installed"], k.torch)
    assert shown["verdict"] == ("DEVIATION" if d["affected"]["installed_in_range"] else "AS SPECIFIED"), shown["output"]
    assert not_shown["verdict"] == "AS SPECIFIED" and not_shown["why"]
    assert "PyTorch version" in d["environment"]
    assert [u["number"] for u in d["upstream"]] == [u.number for u in k.upstream]


def test_the_markdown_body_has_every_section_a_maintainer_needs(tmp_path, cli_in_process):
    out = tmp_path / "issue.md"
    proc = cli_in_process("finding", "fsdp1-tied-param-flattened-twice", "--no-run", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    md = out.read_text()
    k = next(k for k in known.load() if k.id == "fsdp1-tied-param-flattened-twice")
    assert md.startswith(f"# {k.title}\n")
    for section in ("### What happens", "### What was expected (limitation", "### Where it comes from", "### Reproduction",
                    "### Affected releases", "### Upstream", "### Versions"):
        assert section in md, section
    assert "> wrap.py, transformer_auto_wrap_policy" in md  # the quoted promise (here: the documented limitation)
    assert "not run (--no-run)" in md and str(k.torch) in md
    assert all(u.url in md for u in k.upstream) or "none found" in md
