"""A conformance run takes its tests slowest first, by the durations recorded
in conformance/suite/durations.json (conformance.plugin.order): pytest-xdist
splits the tests between its workers in their order, and a long test left
to the end keeps one worker busy while the other idles."""

import json
import subprocess
import sys
from pathlib import Path
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
    gone, or now shorter than MIN_SECONDS, is dropped; a broken file is empty."""
    path = tmp_path / "durations.json"
    kept = "conformance/suite/test_checkpoint.py::test_checkpoint_round_trip[gloo]"
    path.write_text(json.dumps({kept: 17.0, "conformance/suite/test_gone.py::t": 3.0,
                                "conformance/suite/test_schedule.py::test_schedule[gloo]": 21.0}))
    got = order.store({"conformance/suite/test_schedule.py::test_schedule[gloo]": 0.1,
                       "conformance/suite/test_summon.py::test_summon_workaround[gloo]": 1.234}, path)
    assert got == {kept: 17.0, "conformance/suite/test_summon.py::test_summon_workaround[gloo]": 1.23}
    assert order.load(path) == got
    path.write_text("{not json")
    assert order.load(path) == {}


def test_the_suite_is_collected_slowest_first():
    """The committed file orders a real collection: the first test collected is
    the longest the file records (without the hook: the suite's first module)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "conformance/suite", "--collect-only", "-q", "-p", "no:xdist",
                           "--conformance-profile=ci", "--report=never"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    collected = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    recorded = order.load()
    in_suite = {k: v for k, v in recorded.items() if k in collected}
    assert len(in_suite) >= 10, "the committed durations name the suite's tests"
    ranked = sorted(in_suite, key=lambda k: -in_suite[k])
    assert collected[:len(ranked)] == ranked


def test_a_run_records_its_durations_through_xdist(tmp_path):
    """--store-durations: the controller writes what its workers reported,
    setup, call and teardown summed; a test under MIN_SECONDS is left out."""
    (tmp_path / "test_timed.py").write_text(
        "import time\n\ndef test_slow():\n    time.sleep(0.7)\n\ndef test_fast():\n    pass\n")
    out = tmp_path / "durations.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path / "test_timed.py"), "-q", "-n", "2", f"--rootdir={tmp_path}",
                           "-c", "/dev/null", "--conformance-profile=dev", "--report=never", "--store-durations",
                           f"--durations-path={out}"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = order.load(out)
    slow = order.key(tmp_path / "test_timed.py", "test_timed.py::test_slow")
    assert list(got) == [slow] and 0.7 <= got[slow] < 30
    assert not Path(str(out) + ".tmp").exists() and not out.with_suffix(".tmp").exists()
