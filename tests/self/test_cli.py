"""Bad input gives one line on stderr and exit status 2; the CLI's happy paths.
Bad input runs the CLI in this process (cli_in_process, tests/conftest.py):
the same main() a subprocess would run, without its seconds of torch import;
test_bad_arguments_are_one_line keeps the entry point itself."""

import json
import subprocess
import sys

import pytest

from conformance.case.examples import lora_model
from conformance.case.spec import CaseSpec, SpecError

pytestmark = pytest.mark.selfcheck


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "conformance.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def assert_one_line_error(proc, needle):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert needle in lines[0]


@pytest.mark.parametrize(
    "text, needle",
    [
        ("{not json", "not valid JSON"),
        ("[]", "must be an object"),
        (json.dumps({"version": 1, "case": {"type": "CaseSpec", "tree": 3}}), "CaseSpec"),
        (json.dumps({"version": 1, "case": {"type": "Nope"}}), "unexpected type"),
    ],
)
def test_malformed_spec_json_is_one_line(tmp_path, text, needle, cli_in_process):
    path = tmp_path / "case.json"
    path.write_text(text)
    assert_one_line_error(cli_in_process("check", path), needle)
    assert_one_line_error(cli_in_process("repro", path), needle)


def test_unknown_invariant_is_one_line(tmp_path, cli_in_process):
    path = tmp_path / "case.json"
    path.write_text(lora_model(num_layers=1).to_json())
    assert_one_line_error(cli_in_process("check", path, "--invariant", "WRAP-NOPE"), "unknown invariant ID 'WRAP-NOPE'")
    assert_one_line_error(cli_in_process("run", "--invariant", "WRAP-NOPE"), "unknown invariant ID 'WRAP-NOPE'")


def test_a_pool_that_cannot_start_is_one_line(tmp_path, cli_in_process, monkeypatch):
    """check and repro start the pool before they import the areas
    (start_engine) and wait for it after: a start that fails is still one
    line, and no process is left behind."""
    from conformance.engine.pool import _live_pools

    path = tmp_path / "case.json"
    path.write_text(lora_model(num_layers=1).to_json())
    before = set(_live_pools)  # this process's other pools (an xdist worker's session pools)
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the fork server exits at once
    assert_one_line_error(cli_in_process("check", path, "--backend", "gloo"), "the pool's fork server did not start")
    assert_one_line_error(cli_in_process("repro", path, "--backend", "gloo", "-o", tmp_path / "r.py"),
                          "the pool's fork server did not start")
    assert set(_live_pools) <= before


def test_unknown_profile_is_one_line(cli_in_process):
    assert_one_line_error(cli_in_process("run", "--profile", "nightly-ish"), "unknown Hypothesis profile")


def test_nccl_without_gpus_is_one_line(tmp_path, cli_in_process):
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    path = tmp_path / "case.json"
    path.write_text(lora_model(num_layers=1).to_json())
    proc = cli_in_process("check", path, "--backend", "nccl", "--world-size", "2")
    assert_one_line_error(proc, "nccl")


@pytest.mark.parametrize("args, world", [(("--backend", "fake"), 4), (("--backend", "gloo"), 2), (("--backend", "nccl"), 2),
                                         (("--backend", "gloo", "--world-size", "3"), 3), ((), 4)])
def test_check_takes_the_world_size_run_gives_the_tier(tmp_path, cli_in_process, monkeypatch, args, world):
    """A report's finding names its tier; `run` gives the gloo / NCCL pool 2
    ranks and the fake tier 4. `check` took 4 everywhere, so a finding's case
    from the gloo tier checked on 4 ranks (thorough seed 24226's ACCUM case:
    KNOWN on 2 ranks, as the run said, PASS on 4)."""
    import conformance.cli.check as check_cli

    seen, started = [], []
    monkeypatch.setattr(check_cli, "check_case_file", lambda spec, selected, backend, world_size, **kw: seen.append(world_size) or 0)
    # the pool started before the areas are imported (start_engine): as many ranks
    monkeypatch.setattr(check_cli, "start_engine", lambda backend, world_size: started.append(world_size))
    path = tmp_path / "case.json"
    path.write_text(lora_model(num_layers=1).to_json())
    proc = cli_in_process("check", path, *args)
    assert proc.returncode == 0, proc.stderr
    assert seen == [world] and started == [world]


def test_check_and_repro_on_a_good_case(tmp_path):
    path = tmp_path / "case.json"
    path.write_text(lora_model(num_layers=1).to_json())
    proc = cli("check", str(path), "--invariant", "frozen")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FROZEN-ERROR: PASS" in proc.stdout
    script = tmp_path / "repro.py"
    assert cli("repro", str(path), "-o", str(script)).returncode == 0
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "AS SPECIFIED: FSDP raised the ValueError naming layers.0.attn" in run.stdout, run.stdout + run.stderr


def _corpus_case(name, tmp_path):
    from conformance.run import corpus

    path = tmp_path / "case.json"
    path.write_text(next(c for c in corpus.load() if c.name == name).spec.to_json())
    return path


def test_check_a_checkpoint_case_on_the_fake_tier_is_one_line(tmp_path, cli_in_process):
    proc = cli_in_process("check", _corpus_case("dcp-optim-state-unfrozen-at-load-missing-key", tmp_path), "--invariant", "CKPT-RESHARD")
    assert_one_line_error(proc, "needs real ranks: use --backend gloo")


@pytest.mark.gloo
def test_check_a_checkpoint_case_runs_its_round_trip(tmp_path):
    """`check` on a checkpoint case saves on its save world and loads on its
    load world (it raised "unknown scenario 'ckpt-roundtrip'" with a traceback)."""
    path = _corpus_case("dcp-optim-state-unfrozen-at-load-missing-key", tmp_path)
    proc = cli("check", str(path), "--backend", "gloo", "--world-size", "2", "--invariant", "CKPT-RESHARD")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "CKPT-RESHARD: KNOWN" in proc.stdout and "dcp-optim-state-unfrozen-at-load-missing-key" in proc.stdout, proc.stdout


def test_spec_round_trips_and_rejects_bad_trees():
    spec = lora_model(num_layers=2)
    assert CaseSpec.from_json(spec.to_json()) == spec
    ns = {}
    exec(spec.to_python(), ns)
    assert ns["spec"] == spec
    with pytest.raises(SpecError, match="unknown class"):
        CaseSpec.from_json(spec.to_json().replace('"LoraMLP"', '"Nope"', 1))


def test_run_nccl_without_gpus_is_one_line(cli_in_process):
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    assert_one_line_error(cli_in_process("run", "--backend", "nccl", "--world-size", "2"), "nccl")


def test_world_size_larger_than_the_gpus_is_one_line(cli_in_process, monkeypatch):
    import torch
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # no GPUs to fake here
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    proc = cli_in_process("run", "--backend", "nccl", "--world-size", "2")
    assert_one_line_error(proc, "backend 'nccl' needs 2 GPUs (one per rank), this machine has 1")


def test_nccl_world_size_1_without_any_gpu_is_one_line(cli_in_process, monkeypatch):
    # a CUDA build of torch on a machine without a GPU (the nccl_check's bad case)
    import torch
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    proc = cli_in_process("run", "--backend", "nccl", "--world-size", "1")
    assert_one_line_error(proc, "backend 'nccl' needs one GPU per rank and this machine has none")


def test_torch_without_distributed_is_one_line(cli_in_process, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_available", lambda: False)
    assert_one_line_error(cli_in_process("run", "--backend", "fake"), "has no torch.distributed")


@pytest.mark.parametrize(
    "text, needle",
    [
        ("{", "is not valid JSON"),
        ('{"schema": "something-else"}', "is not an fsdp-conformance report"),
        ('{"schema": "fsdp-conformance-report", "schema_version": 7, "results": []}', "schema_version 7"),
    ],
)
def test_malformed_report_or_baseline_is_one_line(tmp_path, text, needle, cli_in_process):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert_one_line_error(cli_in_process("compare", bad, bad), needle)
    assert_one_line_error(cli_in_process("run", "--backend", "fake", "--baseline", bad), needle)
    assert_one_line_error(cli_in_process("repro", bad), needle)
    assert_one_line_error(cli_in_process("compare", tmp_path / "missing.json", tmp_path / "missing.json"), "cannot read report")


@pytest.mark.parametrize("args", [["run", "--backend", "nope"], ["run", "--world-size", "0"], ["run", "--frobnicate"], ["compare", "a.json"]])
def test_bad_arguments_are_one_line(args):
    proc = cli(*args)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.fake
def test_check_runs_each_scenario_once_for_all_its_invariants(monkeypatch, capsys):
    """`check` checks a case as `run` checks an example: the known failures
    read once, each scenario run once and every selected invariant of it
    checked on that observation (it ran the scenario and re-read
    known_failures.toml once per invariant)."""
    from conformance import areas
    from conformance.cli import cases as cli_cases
    from conformance.run import known, runner
    from tests.self.cases import two_blocks

    calls = {"observations": [], "load": 0}
    observe, load = runner.observations, known.load

    def counting_observations(engine, spec, scenario, **kw):
        calls["observations"].append(scenario)
        return observe(engine, spec, scenario, **kw)

    def counting_load(*a, **kw):
        calls["load"] += 1
        return load(*a, **kw)

    monkeypatch.setattr(runner, "observations", counting_observations)
    monkeypatch.setattr(known, "load", counting_load)
    selected = areas.select(["autowrap"])
    assert len(selected) > 3
    rc = cli_cases.check_case_file(two_blocks(), selected, "fake", 2)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert calls["load"] == 1 and len(calls["observations"]) == len(set(calls["observations"])) == 1, calls
    assert all(f"{inv.id}: " in out for inv in selected), out


def test_run_forks_pytest_only_where_the_fork_has_the_fsdp_a_fresh_process_would(monkeypatch, tmp_path):
    """run / hunt / change start pytest in a fork of the CLI (which has
    imported torch and FSDP already): right only when the FSDP imported here
    is the one the environment names; after --fsdp-source (set once this
    process imported the installed FSDP) a fresh process must start."""
    from conformance.cli import pytest_run
    from conformance.selfcheck import fsdp_source

    monkeypatch.delenv(fsdp_source.ENV_VAR, raising=False)
    monkeypatch.setattr(fsdp_source, "active_root", lambda: None)
    assert pytest_run._fork_keeps_fsdp()
    monkeypatch.setenv(fsdp_source.ENV_VAR, str(tmp_path))
    assert not pytest_run._fork_keeps_fsdp()  # the overlay came after FSDP was imported
    monkeypatch.setattr(fsdp_source, "active_root", lambda: tmp_path.resolve())
    assert pytest_run._fork_keeps_fsdp()  # in effect since this process imported conformance
    monkeypatch.delenv(fsdp_source.ENV_VAR)
    assert not pytest_run._fork_keeps_fsdp()  # --fsdp-source installed after an inherited overlay


def test_a_forked_pytest_reports_its_exit_status_and_output(tmp_path):
    """The fork runs pytest as `python -m pytest` would: its exit status
    (1: a test failed), its output in the log. Forked from a process of its
    own (this xdist worker has threads)."""
    (tmp_path / "test_one.py").write_text("def test_fails():\n    assert 1 == 2\n")
    script = f"""
from conformance.cli import pytest_run
with open({str(tmp_path / "pytest.log")!r}, "w") as log:
    proc = pytest_run._ForkedPytest([{str(tmp_path / "test_one.py")!r}, "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                                     "--rootdir={tmp_path}", "-c", "/dev/null"], log)
    print("exit", proc.wait(), proc.poll())
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "exit 1 1", proc.stdout + proc.stderr
    log = (tmp_path / "pytest.log").read_text()
    assert "1 failed" in log and "assert 1 == 2" in log, log


def _crash_finding(tmp_path, history):
    """A CRASH finding as a report keeps it: its case (a plain FSDP1 wrap
    that passes on fresh ranks) and the examples its ranks ran before it."""
    from tests.self.cases import two_blocks

    case = two_blocks()
    finding = {"id": "WRAP-UNITS/fsdp1/gloo/CRASH", "invariant": "WRAP-UNITS", "kind": "CRASH", "spec": json.loads(case.to_json()),
               "violations": [], "engine": {"verdict": "CRASH", "backend": "gloo", "world_size": 2, "replay": "did not crash",
                                            "history": [{"scenario": s, "spec": case.to_json()} for s in history]}}
    path = tmp_path / "finding.json"
    path.write_text(json.dumps(finding))
    return path


@pytest.mark.gloo
def test_repro_of_a_crash_replays_the_examples_its_ranks_ran_before_it(tmp_path):
    """A CRASH that only the examples before it set up (RankPool keeps them
    as the finding's engine.history): `repro` runs them first, in order, on
    the ranks that then run the case, so the crash reproduces; --no-history
    runs the case alone, which passes. The history's example arms FSDP1 in
    the rank processes (rank 1 dies as the next wrap starts)."""
    path = _crash_finding(tmp_path, ["echo", "arm_fsdp1_segfault"])
    alone = cli("repro", str(path), "--no-history", "--backend", "gloo", "--invariant", "WRAP-UNITS", "-o", str(tmp_path / "r.py"))
    assert alone.returncode == 0 and "WRAP-UNITS: PASS" in alone.stdout, alone.stdout + alone.stderr
    after = cli("repro", str(path), "--backend", "gloo", "--invariant", "WRAP-UNITS", "-o", str(tmp_path / "r.py"))
    assert after.returncode == 1, after.stdout + after.stderr
    assert "replaying the 2 example(s) the crashed ranks ran before the case" in after.stdout, after.stdout
    assert "WRAP-UNITS: CRASH" in after.stdout and "Traceback" not in after.stderr, after.stdout + after.stderr
    # a history naming a scenario this installation lacks: one line, exit 2
    unknown = cli("repro", str(_crash_finding(tmp_path, ["no-such-scenario"])), "--backend", "gloo", "-o", str(tmp_path / "r.py"))
    assert_one_line_error(unknown, "example 1 of the history cannot run here")


def test_repro_history_that_cannot_run_is_one_line(tmp_path, cli_in_process):
    path = _crash_finding(tmp_path, ["echo"])
    bad = json.loads(path.read_text())
    bad["engine"]["history"][0]["spec"] = "{not json"
    path.write_text(json.dumps(bad))
    assert_one_line_error(cli_in_process("repro", path, "--backend", "gloo"), "example 1 of the finding's engine.history")
    path = _crash_finding(tmp_path, ["echo"])
    assert_one_line_error(cli_in_process("repro", path, "--backend", "fake"), "engine.history runs on real ranks")


def test_check_no_known_fails_a_recorded_finding_s_deviation(tmp_path, cli_in_process):
    """A recorded finding's case is KNOWN (exit 0) under `check`; with
    --no-known (what a replay repro runs) the oracle alone judges it: FAIL,
    exit 1. A case that holds passes either way."""
    from conformance.run import corpus

    (case,) = [c for c in corpus.load() if c.name == "fsdp1-callable-policy-frozen-not-validated"]
    path = tmp_path / "case.json"
    path.write_text(case.spec.to_json())
    inv = case.invariants[0]
    known = cli_in_process("check", path, "--invariant", inv)
    assert known.returncode == 0 and f"{inv}: KNOWN" in known.stdout, known.stdout + known.stderr
    strict = cli_in_process("check", path, "--invariant", inv, "--no-known")
    assert strict.returncode == 1 and f"{inv}: FAIL" in strict.stdout, strict.stdout + strict.stderr
    good = tmp_path / "good.json"
    good.write_text(lora_model(num_layers=1).to_json())
    assert cli_in_process("check", good, "--invariant", "WRAP-FQNS", "--no-known").returncode == 0
