"""Hunting mode: it finds a regression, keeps it in the example database, and
the next run replays it before drawing anything; its bad input is one line."""

from __future__ import annotations

import json

import pytest

from conformance.run import corpus, profiles
from conformance.run.features import case_features
from tests.self import cases
from tests.self.test_cli import assert_one_line_error

pytestmark = pytest.mark.selfcheck

FAULT = ["--", "-p", "tests.self.fault_plugin"]  # ghost frozen parameter: FROZEN-CLEAN turns red


def _run(*args, timeout=300, env=None):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "conformance.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_a_hunt_keeps_what_it_found_and_the_next_run_replays_it(tmp_path):
    db = tmp_path / "db"
    # no regression corpus: its cases are explicit examples, which fail before
    # anything is drawn and which Hypothesis keeps in no database (the ghost
    # fails them too, now that a message naming it is never an aliasing finding's)
    no_corpus = {corpus.ENV_VAR: str(tmp_path / "no-corpus")}
    # a round of 400 examples: the hunt draws at random and stops at the first
    # failure; with the default 50 a round can miss the ghost (it needs a policy
    # object and a uniform unit: one loaded CI run drew 50 without one)
    hunt = _run("hunt", "--minutes", "0.05", "--examples", "400", "--backend", "fake", "--invariant", "FROZEN-CLEAN",
                "--database", str(db), "--report-dir", str(tmp_path / "hunt"), *FAULT, env=no_corpus)
    assert hunt.returncode == 1, hunt.stdout + hunt.stderr
    assert "NEW FAIL FROZEN-CLEAN/fsdp1/fake" in hunt.stdout
    summary = json.loads((tmp_path / "hunt" / "hunt.json").read_text())
    assert summary["unexplained"] and summary["rounds"]
    assert any(db.rglob("*")), "the hunt kept nothing in the example database"

    # --replay draws nothing: a failure can only come from the database
    replay = _run("run", "--replay", "--backend", "fake", "--invariant", "FROZEN-CLEAN", "--database", str(db),
                  "--report-dir", str(tmp_path / "replay"), "--progress", "quiet", *FAULT, env=no_corpus)
    assert replay.returncode == 1, replay.stdout + replay.stderr
    report = json.loads((tmp_path / "replay" / "report.json").read_text())
    assert [r["verdict"] for r in report["results"] if r["invariant"] == "FROZEN-CLEAN"] == ["FAIL"]

    # the same replay on an empty database (and without the fault) has nothing to check
    empty = _run("run", "--replay", "--backend", "fake", "--invariant", "FROZEN-CLEAN", "--database", str(tmp_path / "empty"),
                 "--report-dir", str(tmp_path / "none"), "--progress", "quiet", env=no_corpus)
    assert empty.returncode == 0, empty.stdout + empty.stderr


def test_hunt_bad_input_is_one_line(tmp_path, cli_in_process):
    assert_one_line_error(cli_in_process("hunt", "--minutes", "0"), "--minutes must be > 0")
    (tmp_path / "f").write_text("x")
    assert_one_line_error(cli_in_process("hunt", "--minutes", "1", "--database", tmp_path / "f"), "is a file")
    assert_one_line_error(cli_in_process("hunt", "--minutes", "1", "--database", "ftp://x"), "expected a directory")
    assert_one_line_error(cli_in_process("run", "--replay"), "--replay needs --database")


def test_databases_from_strings(tmp_path, monkeypatch):
    from hypothesis.database import DirectoryBasedExampleDatabase, MultiplexedDatabase

    assert profiles.database_from("none") is None
    assert isinstance(profiles.database_from(str(tmp_path / "db")), DirectoryBasedExampleDatabase)
    monkeypatch.setenv(f"{profiles.DATABASE_VAR}_CACHE", str(tmp_path / "cache"))
    assert isinstance(profiles.database_from("github:pytorch/pytorch"), MultiplexedDatabase)  # nothing fetched yet
    with pytest.raises(profiles.DatabaseError, match="github:OWNER/REPO"):
        profiles.database_from("github:pytorch")


def test_case_features_of_a_hand_written_case():
    # M(scale[2]; a: A(l: Linear(3, 3)); b: B(l: Linear(3, 3), frozen); z: Linear(2, 2)), units a, b, root
    spec = cases.two_blocks(use_orig_params=True, frozen_b=True)
    assert case_features(spec, 2) == ["all-frozen unit"]  # unit numels 12, 12, 8: even at W=2
    assert case_features(spec, 5) == ["uneven shard", "all-frozen unit"]
    assert case_features(spec, 16) == ["uneven shard", "empty shard", "all-frozen unit"]
