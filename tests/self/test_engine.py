"""The engine's own tests: the rank pool (examples, hangs, crashes, exits),
the fake tier, the torchrun entry."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conformance.case.examples import lora_model
from conformance.case.model_case import ModelCase
from conformance.case.spec import CaseSpec, ModuleSpec, ModuleWrap, ParamSpec, WrapPlan
from conformance.engine import (
    CRASH,
    HANG,
    BackendUnavailable,
    EngineError,
    FakeEngine,
    PoolStartError,
    RankCrash,
    RankHang,
    RankPool,
    resolve_backend,
    scenario_names,
)
from conformance.engine.scenarios import scenario
from tests.self.torchrun import torchrun_env

pytestmark = pytest.mark.selfcheck

DEADLINE = 4.0
RECORD_KEYS = {"rank", "ok", "value", "seconds"}


def small_spec(seed: int = 0) -> CaseSpec:
    return CaseSpec(tree=ModuleSpec("", "Module", (ParamSpec("w", (2, 3)),)), seed=seed)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], within: float = 5.0) -> list[int]:
    """The pids still alive after ``within`` seconds."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def check_echo(records: list[dict], seed: int, pids: list[int] | None = None) -> None:
    assert [r["rank"] for r in records] == [0, 1]
    for r in records:
        assert set(r) == RECORD_KEYS and r["ok"], r
        v = r["value"]
        assert (v["rank"], v["world_size"], v["seed"], v["rank_sum"]) == (r["rank"], 2, seed, 3)
        if pids is not None:
            assert v["pid"] == pids[r["rank"]]


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2, "gloo", deadline=DEADLINE)
    yield p
    pids = p.pids + [p.forkserver_pid]
    p.close()
    assert wait_gone(pids) == []


# ---- the pool ----------------------------------------------------------------


@scenario("case-as-received", test_only=True)
def case_as_received(spec) -> dict:
    return {"type": type(spec).__name__, "json": spec.to_json()}


@pytest.mark.gloo
def test_a_rank_receives_the_drivers_case_as_it_was(pool):
    """A case crosses the pipe pickled (pool.ship), not as JSON that each
    rank decodes and validates again: a CaseSpec and a ModelCase arrive
    equal to the driver's, and the pickle leaves the cached JSON behind."""
    cases = [lora_model(num_layers=2, seed=3), small_spec(9),
             ModelCase("tests.self.same_name_target:target", frozen=("blocks.0.attn.base_layer.weight",),
                       plan=WrapPlan("fsdp1", ModuleWrap(("Linear",)), True))]
    for case in cases:
        before = len(pickle.dumps(case))
        case.to_json()  # cached on the object from now on
        assert len(pickle.dumps(case)) == before
        for r in pool.run("case-as-received", case):
            assert r["ok"], r
            assert r["value"] == {"type": type(case).__name__, "json": case.to_json()}


@pytest.mark.gloo
def test_pool_runs_many_examples_on_the_same_processes(pool):
    pids, generation = pool.pids, pool.generation
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for seed in range(40):
        check_echo(pool.run("echo", small_spec(seed)), seed, pids)
    check_echo(pool.run("echo", lora_model(num_layers=1, seed=5)), 5, pids)
    assert pool.pids == pids and pool.generation == generation


@pytest.mark.gloo
def test_a_record_whose_groups_are_spent_makes_the_pool_start_fresh_ranks(pool):
    """A scenario whose own group timed out says so (spent_process_groups):
    the next example runs on new rank processes."""
    pids, rebuilds = pool.pids, pool.rebuilds
    records = pool.run("spend-groups", small_spec(3))
    assert all(r["ok"] and r["value"]["spent_process_groups"] for r in records), records
    assert pool.rebuilds == rebuilds + 1 and not set(pool.pids) & set(pids)
    check_echo(pool.run("echo", small_spec(4)), 4, pool.pids)


@pytest.mark.gloo
def test_scenario_exception_is_an_error_record_and_the_pool_goes_on(pool):
    pids, rebuilds = pool.pids, pool.rebuilds
    records = pool.run("raise", small_spec(7))
    assert [r["ok"] for r in records] == [False, False]
    for r in records:
        assert r["error"]["type"] == "ValueError"
        assert r["error"]["message"] == f"scenario 'raise' raised on rank {r['rank']} (seed 7)"
        assert "Traceback" in r["error"]["traceback"]
    # the ranks are still in step: same processes, collectives still match
    assert pool.rebuilds == rebuilds
    check_echo(pool.run("echo", small_spec(8)), 8, pids)


@pytest.mark.gloo
def test_hang_is_reported_with_every_rank_stack_and_the_pool_rebuilds(pool):
    pool.run("echo", small_spec())
    old = pool.pids
    spec = small_spec(11)
    start = time.monotonic()
    with pytest.raises(RankHang) as info:
        pool.run("sleep_forever", spec, deadline=2.5)
    assert time.monotonic() - start < 2.5 + 6  # deadline, stack dumps, teardown
    e = info.value
    assert e.verdict == HANG and e.spec is spec and e.scenario == "sleep_forever"
    assert "\n" not in str(e) and str(e).startswith("HANG: scenario 'sleep_forever'")
    assert [(r.rank, r.state) for r in e.ranks] == [(0, "running"), (1, "running")]
    assert "in barrier" in e.ranks[0].stack and "in sleep_forever" in e.ranks[0].stack
    assert "in sleep_forever" in e.ranks[1].stack and "time.sleep" not in e.ranks[1].stack
    assert "spec = CaseSpec(" in e.report()
    json.dumps(e.to_dict())
    assert wait_gone(old) == []
    # the next example runs on fresh ranks
    check_echo(pool.run("echo", small_spec(12)), 12)
    assert set(pool.pids).isdisjoint(old)


@pytest.mark.gloo
def test_a_hang_is_declared_once_no_running_rank_uses_cpu(pool, monkeypatch):
    """Every rank blocked (a barrier one rank never leaves, a sleep): the
    HANG comes after idle_deadline seconds without CPU, not at the deadline
    (ci seed 81's rank-divergent hang held its worker 60 s an example, and
    Hypothesis shrinks a hang through many)."""
    monkeypatch.setattr(pool, "idle_deadline", 1.5)
    start = time.monotonic()
    with pytest.raises(RankHang) as info:
        pool.run("sleep_forever", small_spec(21), deadline=60)
    assert time.monotonic() - start < 1.5 + 8  # the idle window, stack dumps, teardown
    e = info.value
    assert e.idle == 1.5 and "no running rank used CPU for 1.5s" in str(e) and "\n" not in str(e)
    assert [(r.rank, r.state) for r in e.ranks] == [(0, "running"), (1, "running")]
    check_echo(pool.run("echo", small_spec(22)), 22)


@pytest.mark.gloo
def test_a_rank_that_computes_while_the_others_wait_is_no_hang(pool, monkeypatch):
    """Rank 0 computes for 3 s while rank 1 waits for it in an all_reduce:
    one rank busy is progress, whatever the idle window."""
    monkeypatch.setattr(pool, "idle_deadline", 1.0)
    records = pool.run("compute_then_reduce", small_spec(23), deadline=60, args={"seconds": 3.0})
    assert [r["ok"] for r in records] == [True, True] and records[0]["value"]["sum"] == 2.0
    with pytest.raises(EngineError, match="idle_deadline must be > 0"):
        RankPool(2, "gloo", idle_deadline=0)


@pytest.mark.gloo
def test_exit_mid_collective_is_a_crash_and_the_pool_rebuilds(pool):
    pool.run("echo", small_spec())
    old = pool.pids
    with pytest.raises(RankCrash) as info:
        pool.run("exit_mid_collective", small_spec(13))
    e = info.value
    assert e.verdict == CRASH and "\n" not in str(e)
    assert (e.ranks[1].state, e.ranks[1].exitcode) == ("exited", 3)
    assert "exited with code 3" in str(e)
    # rank 0 saw its peer vanish (a gloo error) or was still waiting
    assert e.ranks[0].state in ("returned", "running") and e.ranks[0].stack
    assert wait_gone(old) == []
    check_echo(pool.run("echo", small_spec(14)), 14)


@pytest.mark.gloo
def test_segfault_is_a_crash_with_the_fatal_stack(pool):
    pool.run("echo", small_spec())
    with pytest.raises(RankCrash) as info:
        pool.run("segfault", small_spec(15))
    r1 = info.value.ranks[1]
    assert (r1.state, r1.exitcode) == ("exited", -signal.SIGSEGV)
    assert "Fatal Python error: Segmentation fault" in r1.stack and "in segfault" in r1.stack
    assert f"killed by signal {int(signal.SIGSEGV)}" in str(info.value)
    check_echo(pool.run("echo", small_spec(16)), 16)


@pytest.mark.gloo
def test_a_crash_is_replayed_on_fresh_ranks_and_says_whether_it_followed(pool, tmp_path):
    """A CRASH runs once more on the rebuilt ranks: a crash the case causes
    crashes again; one that what the old ranks ran before set up (a marker
    file here, a corrupted heap in the wild) does not, and the verdict says
    so, in its line and in its record."""
    with pytest.raises(RankCrash) as info:
        pool.run("segfault", small_spec(15))
    assert info.value.replay == "crashed again" and str(info.value).endswith("replayed on fresh ranks: crashed again")
    with pytest.raises(RankCrash) as info:
        pool.run("segfault_once", small_spec(15), args={"marker": str(tmp_path / "crashed")})
    e = info.value
    assert e.replay.startswith("did not crash") and "\n" not in str(e) and "replayed on fresh ranks: did not crash" in str(e)
    assert e.to_dict()["replay"] == e.replay
    check_echo(pool.run("echo", small_spec(16)), 16)


@pytest.mark.gloo
def test_a_crash_set_up_by_earlier_examples_is_replayed_after_them(pool, tmp_path):
    """A CRASH that does not follow its case on fresh ranks runs once more
    after the examples the crashed ranks ran before it, in order: where that
    sequence crashes again it is the reproduction, kept in the record; where
    it does not, the verdict says so too."""
    check_echo(pool.run("echo", small_spec(20)), 20)
    pool.run("arm", small_spec(21))
    with pytest.raises(RankCrash) as info:
        pool.run("crash_if_armed", small_spec(22))
    e = info.value
    assert e.replay.startswith("did not crash") and "it crashed again: that sequence reproduces it" in e.replay, e.replay
    history = e.to_dict()["history"]  # this generation's: the module's pool may have run others before
    assert f"after the {len(history)} examples before it" in e.replay and "\n" not in str(e)
    assert [h["scenario"] for h in history[-2:]] == ["echo", "arm"]
    assert [CaseSpec.from_json(h["spec"]).seed for h in history[-2:]] == [20, 21]
    # a crash that no history sets up (the marker file): neither replay crashes
    pool.run("echo", small_spec(23))
    with pytest.raises(RankCrash) as info:
        pool.run("segfault_once", small_spec(24), args={"marker": str(tmp_path / "crashed")})
    e = info.value
    assert e.replay.endswith("nor after the 1 examples before it, replayed in order on fresh ranks"), e.replay
    assert [h["scenario"] for h in e.to_dict()["history"]] == ["echo"]
    # the history is the crashed generation's own: fresh ranks start with none
    with pytest.raises(RankCrash) as info:
        pool.run("segfault", small_spec(25))
    assert info.value.replay == "crashed again" and "history" not in info.value.to_dict()
    check_echo(pool.run("echo", small_spec(26)), 26)


@pytest.mark.gloo
def test_rank_killed_mid_example_or_between_examples(pool):
    pool.run("echo", small_spec())
    victim = pool.pids[1]
    threading.Timer(0.5, os.kill, (victim, signal.SIGKILL)).start()
    with pytest.raises(RankCrash) as info:
        pool.run("sleep_forever", small_spec(17), deadline=30, replay=False)  # replayed, it would sleep out its deadline
    assert (info.value.ranks[1].state, info.value.ranks[1].exitcode) == ("exited", -signal.SIGKILL)
    assert info.value.elapsed < 10
    # killed while idle: the next run notices, rebuilds first, and succeeds
    pool.run("echo", small_spec())
    rebuilds = pool.rebuilds
    os.kill(pool.pids[0], signal.SIGKILL)
    assert wait_gone([pool.pids[0]]) == []
    check_echo(pool.run("echo", small_spec(18)), 18)
    assert pool.rebuilds == rebuilds + 1 and "died between examples" in pool.events[-1]
    # the fork server killed: its ranks die with it; the next run starts both anew
    server, ranks = pool.forkserver_pid, pool.pids
    os.kill(server, signal.SIGKILL)
    assert wait_gone([server] + ranks) == []
    check_echo(pool.run("echo", small_spec(19)), 19)
    assert pool.forkserver_pid != server


def test_a_ranks_held_proc_file_tells_alive_zombie_and_reaped():
    """The pool reads each rank's state and CPU time from its /proc stat file
    held open (a pread per example, not an open): a zombie is dead, a reaped
    process is dead, and without the held file the path is read instead."""
    from conformance.engine.pool import _Rank

    if not os.path.isdir("/proc"):
        pytest.skip("no /proc on this platform")
    proc = subprocess.Popen([sys.executable, "-c", "import time; sum(range(10**6)); time.sleep(60)"])
    r = _Rank(0, proc.pid, -1, -1, os.devnull)
    r.open_stat()
    try:
        assert r.stat_fd is not None and r.alive()
        end = time.monotonic() + 5
        while (r.cpu_seconds() or 0.0) <= 0.0 and time.monotonic() < end:
            time.sleep(0.02)
        assert r.cpu_seconds() > 0.0
        proc.kill()
        end = time.monotonic() + 5
        while r.alive() and time.monotonic() < end:
            time.sleep(0.01)
        assert not r.alive() and r.stat()[0] == b"Z"  # not yet waited for: a zombie, and dead
        proc.wait()
        assert not r.alive() and r.stat() is None and r.cpu_seconds() is None  # reaped
    finally:
        proc.kill()
        proc.wait()
        r.close_stat()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        by_path = _Rank(0, live.pid, -1, -1, os.devnull)  # no held file: pid_alive's reading
        assert by_path.stat_fd is None and by_path.alive() and by_path.cpu_seconds() is not None
    finally:
        live.kill()
        live.wait()
    assert not by_path.alive()


@pytest.mark.gloo
def test_fsdp1_scenario_runs_in_the_pool(pool):
    records = pool.run("fsdp1", lora_model(num_layers=1, use_orig_params=True), deadline=60)
    assert all(r["ok"] for r in records), records
    assert [r["value"]["rank"] for r in records] == [0, 1]
    assert records[0]["value"]["world_size"] == 2


@pytest.mark.gloo
def test_two_pools_at_once_then_close_leaves_no_process():
    # made at the same time, from threads that end before the pools are used
    made: dict[int, RankPool] = {}

    def make(i: int) -> None:
        made[i] = RankPool(2, "gloo", DEADLINE, preload=())

    threads = [threading.Thread(target=make, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = made[0], made[1]
    try:
        for seed in range(3):
            check_echo(a.run("echo", small_spec(seed)), seed, a.pids)
            check_echo(b.run("echo", small_spec(seed)), seed, b.pids)
        pids = a.pids + b.pids + [a.forkserver_pid, b.forkserver_pid]
        assert len(set(pids)) == 6
    finally:
        a.close()
        b.close()
    assert wait_gone(pids) == []
    assert not os.path.exists(a._dir)
    with pytest.raises(EngineError, match="closed"):
        a.run("echo", small_spec())
    a.close()  # idempotent


@scenario("modules-loaded", test_only=True)
def modules_loaded(spec) -> dict:
    """The modules this rank has before the example imports anything (this
    test module imports no area)."""
    return {"modules": sorted(m for m in sys.modules if m.startswith("conformance."))}


@pytest.mark.gloo
def test_a_pool_made_without_waiting_forks_its_ranks_at_its_first_example():
    """RankPool(wait=False), as `check` and `repro` make it before they
    import the areas: only the fork server starts, and it works out the
    default preload itself (the driver lists none: DEFAULT_PRELOAD); the
    first run forks the ranks, which have every module the driver's
    default_preload() names; closing leaves no process."""
    from conformance.engine.pool import DEFAULT_PRELOAD
    from conformance.engine.scenarios import default_preload

    p = RankPool(2, "gloo", DEADLINE, wait=False)
    try:
        assert p.pids == [] and alive(p.forkserver_pid)
        assert p.preload_arg() == (DEFAULT_PRELOAD,)
        records = p.run("modules-loaded", small_spec(), deadline=60)
        assert all(r["ok"] for r in records), records
        assert len(p.pids) == 2
        for r in records:
            assert set(default_preload()) <= set(r["value"]["modules"]), r["value"]["modules"]
        check_echo(p.run("echo", small_spec(3)), 3, p.pids)
        pids = p.pids + [p.forkserver_pid]
    finally:
        p.close()
    assert wait_gone(pids) == []
    assert not os.path.exists(p._dir)


@pytest.mark.gloo
def test_a_pool_made_without_waiting_reports_a_failed_start_when_it_is_waited_for(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the fork server exits at once
    p = RankPool(2, "gloo", DEADLINE, wait=False)
    try:
        with pytest.raises(PoolStartError, match="fork server did not start"):
            p.wait_ready()
    finally:
        p.close()
    with pytest.raises(EngineError, match="closed"):
        p.wait_ready()


@pytest.mark.gloo
def test_a_rank_that_fails_to_start_names_why():
    """A rank whose start raised (here init_process_group, patched in the
    fork server by a preloaded module): the pool's error ends with the
    exception, which the rank wrote to its log before it exited."""
    with pytest.raises(PoolStartError, match=r"rank 0 of 1 did not start \(exited\): RuntimeError: injected: this rank cannot join its group"):
        RankPool(1, "gloo", DEADLINE, preload=("tests.self.broken_start",))


def _stuck_pool(world_size: int, startup_deadline: float) -> RankPool:
    """A pool whose rank 0 hangs in init_process_group (tests.self.stuck_start),
    its fork server started and ready first: the deadline then times the
    ranks' start only, not the server importing torch (seconds under load)."""
    pool = RankPool(world_size, "gloo", DEADLINE, startup_deadline=startup_deadline, preload=("tests.self.stuck_start",), wait=False)
    pool._server.wait_ready(time.monotonic() + 120)
    return pool


def test_a_start_that_times_out_is_tried_once_more(tmp_path, monkeypatch):
    """No rank raised, one was not ready in time (seen under load on 2
    cores): the pool starts fresh ranks once more, and says so in its
    events, with where the stuck rank was."""
    monkeypatch.setenv("FSDP_CONFORMANCE_STUCK_ONCE", str(tmp_path / "stuck-once"))
    pool = _stuck_pool(2, 5.0)
    try:
        with pytest.warns(RuntimeWarning, match="did not start .*, started again"):
            pool.wait_ready()
        assert pool.generation == 2 and len(pool.events) == 1, pool.events
        assert "rank 0 of 2 did not start (not ready after 5s), started again: rank 0 at _stuck_in_init (stuck_start.py:" in pool.events[0]
        check_echo(pool.run("echo", small_spec(3)), 3, pool.pids)
    finally:
        pool.close()


def test_a_start_that_times_out_twice_names_where_the_rank_was(monkeypatch):
    monkeypatch.setenv("FSDP_CONFORMANCE_STUCK_ONCE", "always")
    pool = _stuck_pool(1, 3.0)
    try:
        with pytest.raises(PoolStartError, match=r"rank 0 of 1 did not start \(not ready after 3s\): rank 0 at _stuck_in_init \(stuck_start\.py:\d+\)"):
            with pytest.warns(RuntimeWarning, match="started again"):
                pool.wait_ready()
        assert pool.generation == 2
    finally:
        pool.close()


@pytest.mark.gloo
def test_a_pool_closed_before_it_was_waited_for_leaves_no_process():
    p = RankPool(2, "gloo", DEADLINE, wait=False)
    server = p.forkserver_pid
    p.close()  # its server still importing torch: killed, not waited for until it would notice (seconds)
    assert p._server.proc.returncode == -signal.SIGKILL
    assert wait_gone([server]) == [] and not os.path.exists(p._dir)


DRIVER = textwrap.dedent(
    """
    import json, signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    from conformance.engine import RankPool
    from conformance.case.spec import CaseSpec, ModuleSpec
    spec = CaseSpec(tree=ModuleSpec("", "Module"))
    if sys.argv[2] == "thread":  # ranks spawned by a thread that has ended
        import threading
        made = []
        t = threading.Thread(target=lambda: made.append(RankPool(2, "gloo", deadline=60, preload=())))
        t.start(); t.join()
        pool = made[0]
    else:
        pool = RankPool(2, "gloo", deadline=60, preload=())
    pool.run("echo", spec)
    print(json.dumps([pool.pids + [pool.forkserver_pid], pool._dir]), flush=True)
    if sys.argv[1] == "busy":
        pool.run("sleep_forever", spec)
    else:
        time.sleep(60)
    """
)


@pytest.mark.gloo
@pytest.mark.parametrize(
    "sig, state, spawner",
    [
        (signal.SIGTERM, "busy", "main"),
        (signal.SIGINT, "idle", "main"),
        (signal.SIGINT, "busy", "main"),
        (signal.SIGKILL, "busy", "main"),
        (signal.SIGKILL, "idle", "thread"),
    ],
    ids=lambda x: getattr(x, "name", x),
)
def test_no_rank_outlives_its_driver(sig, state, spawner):
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, state, spawner], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = driver.stdout.readline()
        assert line, driver.stderr.read()
        pids, folder = json.loads(line)
        assert all(alive(p) for p in pids) and os.path.isdir(folder)
        time.sleep(0.5)  # busy: the driver now waits in run()
        driver.send_signal(sig)
        driver.wait(timeout=20)
        assert wait_gone(pids) == [], f"pool processes outlived a driver ended by {sig.name}"
        assert not os.path.exists(folder)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


# ---- backends ----------------------------------------------------------------


def test_nccl_without_enough_gpus_is_a_one_line_error():
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    start = time.monotonic()
    with pytest.raises(BackendUnavailable) as info:
        RankPool(2, "nccl", deadline=DEADLINE)
    msg = str(info.value)
    assert "\n" not in msg and "nccl" in msg and "gloo" in msg
    assert time.monotonic() - start < 10
    with pytest.raises(BackendUnavailable):
        resolve_backend("nccl", 2)
    assert resolve_backend("auto", 2) == "gloo"
    assert resolve_backend("fake", 8) == "fake"
    with pytest.raises(EngineError, match="unknown backend"):
        resolve_backend("mpi", 2)


def test_scenario_registry():
    assert "fsdp1" in scenario_names()
    assert "echo" not in scenario_names()
    assert {"echo", "raise", "sleep_forever", "exit_mid_collective", "segfault"} <= set(
        scenario_names(include_test_only=True)
    )
    with FakeEngine(2) as fake, pytest.raises(EngineError, match="unknown scenario 'nope'"):
        fake.run("nope", small_spec())


# ---- the fake tier ---------------------------------------------------------------


@pytest.mark.fake
def test_fake_engine_runs_in_process_with_the_pool_record_shape():
    with FakeEngine(4) as fake:
        [r] = fake.run("echo", small_spec(3))
        assert set(r) == RECORD_KEYS and r["ok"]
        assert (r["value"]["rank"], r["value"]["world_size"], r["value"]["seed"]) == (0, 4, 3)
        assert r["value"]["pid"] == os.getpid()
        [r] = fake.run("raise", small_spec(4))
        assert not r["ok"] and r["error"]["type"] == "ValueError"
        for name in ("sleep_forever", "exit_mid_collective", "segfault"):
            with pytest.raises(EngineError, match="hangs or kills"):
                fake.run(name, small_spec())
        [r] = fake.run("fsdp1", lora_model(num_layers=1))
        assert r["ok"], r
        assert r["value"]["world_size"] == 4
    # another world size in the same process
    with FakeEngine(2) as fake:
        assert fake.run("echo", small_spec())[0]["value"]["world_size"] == 2


PROFILE_SCRIPT = textwrap.dedent(
    """
    import sys
    from hypothesis import settings
    settings.register_profile("suite", max_examples=7)
    settings.register_profile("dev", max_examples=3)  # a name torch's common_utils also registers
    settings.load_profile("suite")
    if sys.argv[1] == "bare":
        import torch.testing._internal.common_utils
    else:
        from conformance.engine.fake import FakeEngine, preserve_hypothesis_profile
        FakeEngine(2).close()
        assert settings.get_current_profile_name() == "suite"
        with preserve_hypothesis_profile():
            import torch.testing._internal.common_utils
    print(settings.get_current_profile_name(), settings.default.max_examples, settings.get_profile("dev").max_examples)
    """
)


@pytest.mark.fake
def test_fake_tier_keeps_the_suite_hypothesis_profile():
    procs = {
        how: subprocess.Popen([sys.executable, "-c", PROFILE_SCRIPT, how], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        for how in ("guarded", "bare")
    }
    out = {}
    for how, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        out[how] = stdout.split()
    assert out["guarded"] == ["suite", "7", "3"]
    # what the guard prevents: torch's test utilities take over the profile
    assert out["bare"][0] != "suite" and out["bare"][1:] != ["7", "3"]


@pytest.mark.fake
def test_drive_hook_runs_a_spec_source():
    from conformance.engine.torchrun import TorchrunEngine, drive

    seen = []
    with FakeEngine(1):
        summary = drive(
            (small_spec(s) for s in range(3)), "echo", engine=TorchrunEngine(),
            on_result=lambda spec, records, agreed: seen.append((spec.seed, agreed)),
        )
    assert seen == [(0, True), (1, True), (2, True)]
    assert summary.ok and summary.examples == 3 and "OK" in summary.line()


# ---- torchrun ------------------------------------------------------------------


@pytest.mark.gloo
def test_torchrun_entry(tmp_path):
    specs = tmp_path / "specs.jsonl"
    specs.write_text(lora_model(num_layers=1).to_json() + "\n" + small_spec(1).to_json() + "\n")
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "conformance.engine.torchrun", "--scenario", "echo", "--specs", str(specs),
            "--seed", "100", "--backend", "gloo", "--out", str(out),
        ],
        capture_output=True, text=True, timeout=180, env=torchrun_env(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "conformance torchrun OK: scenario=echo backend=gloo world_size=2 examples=2 agree=2" in proc.stdout
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [CaseSpec.from_json(x["spec"]).seed for x in lines] == [100, 101]
    for x in lines:
        assert x["agree"] and [r["value"]["rank"] for r in x["records"]] == [0, 1]
        assert x["records"][0]["value"]["pid"] != x["records"][1]["value"]["pid"]
    # torchrun's own log directory went to this test's directory, not /tmp
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("torchelastic_")], list(tmp_path.iterdir())


@scenario("test:dtensor-op-on-a-one-rank-mesh", test_only=True)
def _dtensor_op_on_a_one_rank_mesh(spec) -> dict:
    """An op on a DTensor over a one-rank mesh: in a world of several ranks
    the mesh is over a subgroup of this rank alone (named after the default
    group), in a world of one over the default group. The two meshes are
    equal as DeviceMesh compares them."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    if dist.get_world_size() > 1:
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        mesh = DeviceMesh.from_group(groups[dist.get_rank()], "cpu")
    else:
        mesh = init_device_mesh("cpu", (1,))
    y = distribute_tensor(torch.ones(3), mesh, [Replicate()]).detach() * 2
    return {"groups": list(y.device_mesh._dim_group_names), "sum": float(y.full_tensor().sum())}


def test_dtensor_ops_after_the_default_group_is_made_again_use_the_new_mesh():
    """Fake worlds of different sizes take turns in one process (each
    destroys the other's default group): DTensor's sharding-propagation
    caches compare meshes without their process groups, and an op after the
    turn must not come out on the previous world's mesh, whose group was
    destroyed (engine.fake.forget_meshes)."""
    spec = lora_model(num_layers=1)
    with FakeEngine(world_size=2) as two:
        two.run("test:dtensor-op-on-a-one-rank-mesh", spec)
    with FakeEngine(world_size=1) as one:
        rec = one.run("test:dtensor-op-on-a-one-rank-mesh", spec)[0]
    assert rec["value"]["groups"] == ["0"] and rec["value"]["sum"] == 6.0, rec


@pytest.mark.gloo
def test_a_pool_of_another_world_size_forks_from_the_base_pools_server(pool):
    """Worlds' other world sizes fork their ranks from the base pool's fork
    server (torch imported once per driver, not once per pool), each its
    own group of its own size; one closed, or the server gone, leaves the
    others working (a pool whose shared server died starts its own)."""
    from conformance.engine.worlds import Worlds

    w = Worlds(pool)
    try:
        four, one = w.engine(4), w.engine(1)
        assert four.forkserver_pid == one.forkserver_pid == pool.forkserver_pid
        recs = four.run("echo", small_spec(3))
        assert [(r["value"]["rank"], r["value"]["world_size"], r["value"]["rank_sum"]) for r in recs] == [(r, 4, 10) for r in range(4)]
        assert len({r["value"]["pid"] for r in recs} | set(pool.pids)) == 6
        check_echo(pool.run("echo", small_spec(4)), 4)
        # a hang in the sharing pool rebuilds its ranks only, from the same server
        base_ranks = pool.pids
        with pytest.raises(RankHang):
            four.run("sleep_forever", small_spec(5), deadline=2.0)
        assert four.forkserver_pid == pool.forkserver_pid and pool.pids == base_ranks
        assert [r["value"]["rank_sum"] for r in four.run("echo", small_spec(6))] == [10] * 4
        # closed: its ranks go, the server and the base pool stay
        ranks4 = four.pids
        four.close()
        assert wait_gone(ranks4) == [] and alive(pool.forkserver_pid)
        check_echo(pool.run("echo", small_spec(7)), 7, base_ranks)
        # the server killed: every pool on it starts a server of its own
        server = pool.forkserver_pid
        os.kill(server, signal.SIGKILL)
        assert wait_gone([server, *pool.pids, *one.pids]) == []
        rec = one.run("echo", small_spec(8))[0]
        assert rec["ok"] and rec["value"]["world_size"] == 1
        check_echo(pool.run("echo", small_spec(9)), 9)
        assert len({server, one.forkserver_pid, pool.forkserver_pid}) == 3
    finally:
        w.close()
    # a module the server did not preload: a server of its own
    with RankPool(1, "gloo", deadline=DEADLINE, preload=("tests.self.faults_tp",), share_server_with=pool) as own:
        assert own.forkserver_pid != pool.forkserver_pid and own.run("echo", small_spec(10))[0]["ok"]


@pytest.mark.gloo
def test_a_one_rank_world_runs_in_a_rank_process_not_the_driver(pool):
    """Worlds' world size 1 (a checkpoint saved or loaded on one rank) is a
    pool of its own: a save that segfaults (fsdp2-tied-list-group-unsharded-
    save-segfault, seed 4711) is a CRASH verdict, not the end of this process."""
    from conformance.engine import pool as pool_mod
    from conformance.engine.worlds import Worlds

    w = Worlds(pool)
    starts = len(pool_mod.STARTS)
    try:
        one = w.engine(1)
        assert isinstance(one, RankPool) and one.world_size == 1
        rec = one.run("echo", small_spec(2))[0]
        assert rec["ok"] and rec["value"]["world_size"] == 1 and rec["value"]["pid"] != os.getpid()
        # the start is on record (the bench counts it as start-up)
        assert [s[0] for s in pool_mod.STARTS[starts:]] == [1] and pool_mod.STARTS[-1][1] > 0
        # a view with its own deadline shares the pools: none started again
        quick = w.view(deadline=5.0)
        assert quick.deadline == 5.0 and quick.engine(1) is one and len(pool_mod.STARTS) == starts + 1
    finally:
        w.close()
    assert one._closed


def test_a_two_phase_example_counts_both_phases_inside_the_ranks():
    """A checkpoint round trip's records carry the time inside both phases'
    scenario functions (the slowest save rank's plus the load rank's own):
    the bench's pool overhead is the driver's wait less this, and with the
    load phase's alone the save phase read as pool overhead (checkpoint's
    gloo row: 109% of FSDP)."""
    from types import SimpleNamespace

    from conformance.engine.worlds import Worlds

    class Base:
        world_size, deadline, backend = 2, 60.0, "gloo"

        def run(self, scenario, spec, deadline=None, args=None):
            secs = {"save": (3.0, 5.0), "load": (1.0, 2.0)}[scenario]
            return [{"rank": r, "ok": True, "value": {"phase": scenario}, "seconds": s} for r, s in enumerate(secs)]

    spec = SimpleNamespace(ckpt=SimpleNamespace(save_world=2, load_world=2))
    recs = Worlds(Base(), phases={"roundtrip": ("save", "load")}).run("roundtrip", spec)
    assert [r["seconds"] for r in recs] == [6.0, 7.0]
    assert [r["value"]["save"] for r in recs] == [{"phase": "save"}] * 2
