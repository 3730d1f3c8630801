"""The suite's own tests: the options, fixtures and report come from the
package's pytest plugin (conformance.plugin, the pytest11 entry point); the
Hypothesis profile is loaded here too, since these tests draw cases."""

import os
import subprocess
import sys

import pytest

from conformance.plugin import ensure_profile


def pytest_configure(config):
    ensure_profile(config)


def pytest_collection_modifyitems(config, items):
    """The `repros` tests (every committed repro script in every mode:
    minutes) run only when asked for: pytest -m repros."""
    if "repros" in (config.getoption("markexpr") or ""):
        return
    keep = [i for i in items if "repros" not in i.keywords]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if "repros" in i.keywords])
        items[:] = keep


# The fault modules the rank processes import (each registers its fault
# scenarios; none patches FSDP at import): one pool per world size, shared by
# every fault test of this pytest process, instead of one per test module
# (a pool's start-up is a torch import and a group init: ~5 s).
FAULT_MODULES = ("tests.self.faults_activation_checkpointing", "tests.self.faults_checkpoint", "tests.self.faults_clip",
                 "tests.self.faults_comm", "tests.self.faults_fsdp2", "tests.self.faults_hsdp", "tests.self.faults_init_order",
                 "tests.self.faults_microbatch", "tests.self.faults_tp", "tests.self.faults_training")


@pytest.fixture(scope="session")
def fault_pools():
    """``fault_pools(world_size)``: the gloo pool of that world size whose
    ranks have every fault module loaded (deadline: 60 s a rank pair, 120 s
    for 4 ranks on 2 cores)."""
    from conformance.engine.pool import RankPool

    made: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in made:
            first = next(iter(made.values()), None)  # its fork server serves every world size
            made[world_size] = RankPool(world_size, "gloo", deadline=60.0 if world_size <= 2 else 120.0,
                                        preload=("conformance.areas.checkpoint.adapter", *FAULT_MODULES),
                                        share_server_with=first)
            made[world_size].tier = "gloo"
        return made[world_size]

    yield get
    for p in reversed(list(made.values())):  # the pools that share the first one's server first
        p.close()


@pytest.fixture
def cli_in_process(capfd):
    """``cli_in_process(*args)``: ``fsdp-conformance ARGS`` run by
    conformance.cli.main in this process, as a CompletedProcess (exit
    status, stdout, stderr). For bad input, which the CLI must reject before
    it starts anything: a subprocess would spend seconds importing torch
    again for each line checked (the entry point itself keeps subprocess
    tests: test_cli.test_bad_arguments_are_one_line). What the CLI changes
    in the environment and sys.path is put back."""
    from conformance.cli import main

    def run(*args) -> subprocess.CompletedProcess:
        env, path = dict(os.environ), list(sys.path)
        capfd.readouterr()
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 1
        finally:
            os.environ.clear()
            os.environ.update(env)
            sys.path[:] = path
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["fsdp-conformance", *args], rc, out, err)

    return run
