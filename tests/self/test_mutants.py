"""The mutant catalog (conformance/mutants.toml) applies to the installed
torch, a mutant that does not apply fails loudly, and a small sample of
mutants is killed by `fsdp-conformance selfcheck --mutants` (the CI
self-test of the mutation score; the full table is reports/mutants.md)."""

import json
import os
import subprocess
import sys

import pytest

from conformance import fsdp_source, mutants

pytestmark = pytest.mark.selfcheck

# fast kills on the fake tier, one per API family
SAMPLE = ["fsdp1-simulation-revisits-units", "fwd-missing-method-not-rejected"]


def test_catalog_is_large_realistic_and_applies():
    catalog = mutants.load()
    assert len(catalog) >= 30
    assert {m.api for m in catalog} == set(mutants.APIS)
    mutants.check_all(catalog)  # raises MutantError naming any that does not apply
    for m in catalog:
        assert len(m.description) > 20, m.id


def test_mutant_that_does_not_apply_fails_loudly(tmp_path):
    m = mutants.Mutant("ghost", "fsdp1", "fsdp/wrap.py", "this text is not in wrap.py", "x", "a mutant of nothing")
    with pytest.raises(mutants.MutantError, match=r"ghost: its find text occurs 0 times in torch/distributed/fsdp/wrap.py"):
        mutants.check_all([m])
    broken = mutants.Mutant("broken", "fsdp1", "fsdp/wrap.py", "def _or_policy(", "def _or_policy((", "does not parse")
    with pytest.raises(mutants.MutantError, match="broken: the mutated torch/distributed/fsdp/wrap.py does not parse"):
        mutants.make_source(broken, tmp_path)


def test_mutant_copy_changes_only_its_file(tmp_path):
    m = next(x for x in mutants.load() if x.id == SAMPLE[0])
    root = mutants.make_source(m, tmp_path / "src")
    assert fsdp_source.differs_from_installed(root) == [m.path]


def test_unknown_mutant_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "conformance.cli", "selfcheck", "--mutants", "--mutant", "no-such-mutant"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "unknown mutant 'no-such-mutant'" in proc.stderr


def test_sample_of_mutants_is_killed(tmp_path):
    """The CI sample: each mutant of SAMPLE killed, with the invariant that
    caught it, through the FSDP-source overlay."""
    out = tmp_path / "sample.json"
    env = {k: v for k, v in os.environ.items() if k != fsdp_source.ENV_VAR}
    args = [sys.executable, "-m", "conformance.cli", "selfcheck", "--mutants", "--examples", "30", "--json", str(out)]
    for m in SAMPLE:
        args += ["--mutant", m]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    outcomes = {o["id"]: o for o in json.loads(out.read_text())["outcomes"]}
    assert outcomes["fsdp1-simulation-revisits-units"]["status"] == "killed"
    assert any(k.startswith("WRAP-FQNS") for k in outcomes["fsdp1-simulation-revisits-units"]["killed_by"])
    assert outcomes["fwd-missing-method-not-rejected"]["status"] == "killed"
    assert any(k.startswith("FWD-MISSING") for k in outcomes["fwd-missing-method-not-rejected"]["killed_by"])
    assert "mutation score: 2/2 non-equivalent mutants killed (100%)" in proc.stdout
