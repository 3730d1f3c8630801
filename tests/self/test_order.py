"""A conformance run takes its tests slowest first, by the durations recorded
in conformance/suite/durations.json (conformance.plugin.order): pytest-xdist
splits the tests between its workers in their order, and a long test left
to the end keeps one worker busy while the other idles."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

from conformance import paths
from conformance.plugin import order

ROOT = paths.PACKAGE.parent


def _item(rel: str, nodeid: str):
    return SimpleNamespace(path=ROOT / rel, nodeid=nodeid)


def test_a_test_has_one_key_whatever_the_rootdir():
    """`fsdp-conformance run` starts pytest with the suite as its rootdir,
    ci/test.sh with the checkout's root: the same test, the same entry."""
    path = paths.SUITE / "test_schedule.py"
    want = "conformance/suite/test_schedule.py::test_schedule[gloo]"
    assert order.key(path, "test_schedule.py::test_schedule[gloo]") == want
    assert order.key(path, "conformance/suite/test_schedule.py::test_schedule[gloo]") == want


def test_the_longest_recorded_test_goes_first_and_the_rest_keep_their_order():
    items = [_item("conformance/suite/test_a.py", f"test_a.py::t{i}") for i in range(5)]
    durations = {order.key(items[3].path, items[3].nodeid): 20.0, order.key(items[1].path, items[1].nodeid): 5.0}
    order.order(items, durations)
    assert [it.nodeid for it in items] == ["test_a.py::t3", "test_a.py::t1", "test_a.py::t0", "test_a.py::t2", "test_a.py::t4"]


def test_storing_merges_with_what_the_file_holds(tmp_path):
    """A run of some tests leaves the others' entries; an entry whose file is
    gone, whose test function is gone from its file (a renamed or split
    test: the schedule test split by API left test_schedule[gloo] behind),
    or that is now shorter than MIN_SECONDS, is dropped; a broken file is empty."""
    path = tmp_path / "durations.json"
    kept = "conformance/suite/test_checkpoint.py::test_checkpoint_round_trip_fsdp2[gloo]"
    path.write_text(json.dumps({kept: 17.0, "conformance/suite/test_gone.py::t": 3.0,
                                "conformance/suite/test_schedule.py::test_schedule[gloo]": 24.98,
                                "conformance/suite/test_schedule.py::test_schedule_fsdp1[gloo]": 21.0}))
    got = order.store({"conformance/suite/test_schedule.py::test_schedule_fsdp1[gloo]": 0.1,
                       "conformance/suite/test_summon.py::test_summon_workaround[gloo]": 1.234}, path)
    assert got == {kept: 17.0, "conformance/suite/test_summon.py::test_summon_workaround[gloo]": 1.23}
    assert order.load(path) == got
    path.write_text("{not json")
    assert order.load(path) == {}


_TIMED = """import os, time

def _ran(name):
    with open(os.environ["ORDER_LOG"], "a") as f:
        f.write(name + "\\n")

def test_a():
    _ran("a")

def test_b():
    _ran("b")
    time.sleep(0.7)

def test_c():
    _ran("c")
"""


def _run(tmp_path, *args):
    (tmp_path / "test_timed.py").write_text(_TIMED)
    log = tmp_path / "ran.txt"
    log.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path / "test_timed.py"), "-q", f"--rootdir={tmp_path}", "-c", "/dev/null",
                           "--conformance-profile=dev", "--report=never", *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "ORDER_LOG": str(log)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return log.read_text().split()


def test_xdist_workers_take_the_tests_slowest_first_and_the_controller_records_durations(tmp_path):
    """--slowest-first on an xdist worker (fsdp-conformance run -n N passes
    it) with --store-durations, in one run: the worker runs c, a, b; the
    controller then writes what the worker reported, setup, call and
    teardown summed: b's 0.7 s, while a and c, measured under MIN_SECONDS,
    leave the file."""
    durations = tmp_path / "durations.json"
    name = lambda t: order.key(tmp_path / "test_timed.py", f"test_timed.py::{t}")  # noqa: E731
    durations.write_text(json.dumps({name("test_c"): 9.0, name("test_a"): 2.0}))
    assert _run(tmp_path, "-n", "1", "--slowest-first", "--store-durations", f"--durations-path={durations}") == ["c", "a", "b"]
    got = order.load(durations)
    assert list(got) == [name("test_b")] and 0.7 <= got[name("test_b")] < 30
    assert not durations.with_suffix(".tmp").exists()


def _sorted_by_the_hook(tmp_path, *, worker: bool, asked: bool) -> list[str]:
    """The plugin's collection hook on three items whose recorded durations
    put c first: as an xdist worker's config or the only process's, with
    --slowest-first or without."""
    import conformance.plugin as plugin

    durations = tmp_path / "durations.json"
    items = [_item("conformance/suite/test_a.py", f"test_a.py::{t}") for t in "abc"]
    durations.write_text(json.dumps({order.key(items[2].path, items[2].nodeid): 9.0}))
    opts = {"--slowest-first": asked, "--durations-path": str(durations)}
    config = SimpleNamespace(getoption=opts.__getitem__, **({"workerinput": {}} if worker else {}))
    plugin.pytest_collection_modifyitems(None, config, items)
    return [it.nodeid.split("::")[1] for it in items]


def test_only_an_xdist_worker_that_is_asked_sorts(tmp_path):
    """In one process pytest's order stays (a hunt's time limit, a mutant's
    first failing test), and so it does where nobody asked (ci/test.sh)."""
    assert _sorted_by_the_hook(tmp_path, worker=True, asked=True) == ["c", "a", "b"]
    assert _sorted_by_the_hook(tmp_path, worker=False, asked=True) == ["a", "b", "c"]
    assert _sorted_by_the_hook(tmp_path, worker=True, asked=False) == ["a", "b", "c"]


def test_the_committed_durations_name_the_suites_tests():
    """The file the suite ships orders real tests: most of its entries for
    the suite are tests the suite collects (a renamed test only loses its
    place, but a file that names none orders nothing)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "conformance/suite", "--collect-only", "-q", "-p", "no:xdist",
                           "--conformance-profile=ci", "--report=never"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    collected = {ln for ln in proc.stdout.splitlines() if "::" in ln}
    suite = [k for k in order.load() if k.startswith("conformance/suite/")]
    assert len(suite) >= 20 and sum(k in collected for k in suite) >= 0.9 * len(suite)


def _run_args(*argv):
    import argparse

    from conformance.cli import run
    from conformance.cli.errors import Parser
    from conformance.cli.pytest_run import conformance_args

    p = Parser(prog="fsdp-conformance")
    run.add_parser(p.add_subparsers(dest="cmd", required=True, parser_class=Parser))
    ns = p.parse_args(["run", *argv])
    assert isinstance(ns, argparse.Namespace)
    return conformance_args(ns, "ci", ROOT / "reports" / "latest")[0]


def test_run_with_workers_asks_for_slowest_first():
    assert "--slowest-first" in _run_args("-n", "2")
    assert "--slowest-first" not in _run_args()  # one process: pytest's order
