"""The suite's agreement channel between a pool's ranks
(conformance.engine.agree), which ranks.py's any_rank_failed, failed_ranks
and all_ranks_equal use instead of a gloo all-reduce: every rank's value in
rank order, a round that arrives early kept for its turn, a silent or
out-of-step peer an error, never a wrong answer."""

import os
import socket
import threading

import pytest

from conformance.case.examples import lora_model
from conformance.engine import agree


def _channels(tmp_path, world: int, timeout: float = 5.0) -> list[agree.Channel]:
    paths = [str(tmp_path / f"r{r}") for r in range(world)]
    out = []
    for r in range(world):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.bind(paths[r])
        out.append(agree.Channel(r, world, paths, s, timeout))
    return out


def _together(channels, values) -> list[list[int]]:
    got: list = [None] * len(channels)

    def one(r):
        got[r] = channels[r].exchange(values[r])

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(channels))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return got


def test_every_rank_gets_every_value_in_rank_order(tmp_path):
    chans = _channels(tmp_path, 3)
    assert _together(chans, [7, -3, 2**62]) == [[7, -3, 2**62]] * 3
    assert _together(chans, [0, 1, 0]) == [[0, 1, 0]] * 3  # the next round
    assert [c.round for c in chans] == [2, 2, 2]


def test_a_round_that_arrives_early_waits_for_its_turn(tmp_path):
    """Rank 2 already in round 2 (it had rank 1's round 1) before rank 1's
    round-1 value reaches rank 0: rank 0's round 1 takes rank 1's round-1
    value, not its round-2 one, and its round 2 the kept one."""
    c0, c1, c2 = _channels(tmp_path, 3)
    c0.sock.sendto(agree._MSG.pack(2, 2, 22), c0.paths[0])  # rank 2's round 2, first
    c0.sock.sendto(agree._MSG.pack(1, 2, 21), c0.paths[0])
    c0.sock.sendto(agree._MSG.pack(1, 1, 11), c0.paths[0])
    c0.sock.sendto(agree._MSG.pack(2, 1, 12), c0.paths[0])
    assert c0.exchange(10) == [10, 11, 21]
    assert c0.exchange(20) == [20, 12, 22]


def test_a_silent_peer_is_a_timeout_and_a_stale_round_an_error(tmp_path):
    c0, c1 = _channels(tmp_path, 2, timeout=0.3)
    with pytest.raises(agree.AgreementError, match=r"round 1: timed out waiting for ranks \[1\]"):
        c0.exchange(1)
    c0.sock.sendto(agree._MSG.pack(1, 1, 5), c0.paths[0])  # rank 1's round 1, now that rank 0 is in round 2
    with pytest.raises(agree.AgreementError, match="rank 1 sent round 1 during round 2"):
        c0.exchange(1)


def test_a_gone_peer_is_an_error(tmp_path):
    c0, c1 = _channels(tmp_path, 2)
    c1.sock.close()
    (tmp_path / "r1").unlink()
    with pytest.raises(agree.AgreementError, match="rank 1 is gone"):
        c0.exchange(0)


@pytest.mark.gloo
def test_a_pools_ranks_agree_on_the_channel(fault_pools):
    import tests.self.rank_scenarios  # noqa: F401  (registers the scenario)

    records = fault_pools(2).run("agree-on-ranks", lora_model(num_layers=1, seed=4))
    assert all(r["ok"] for r in records), records
    for r in records:
        v = r["value"]
        assert v["channel"] and v["rounds_after"] - v["rounds_before"] == 5, v
        assert (v["any_failed"], v["failed"], v["none_failed"], v["equal"], v["unequal"]) == (True, 1, False, True, False), v


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3])
def test_full_tensors_equals_full_tensor_bitwise(fault_pools, world):
    """fsdp2_adapter.full_tensors (every sharded value in two all-gathers)
    gives what DTensor.full_tensor() gives, value for value, dtype and
    shape included, on uneven and empty shards and Shard(1); anything else
    (Replicate, a plain tensor, None) as full_tensor() or as it is."""
    import tests.self.rank_scenarios  # noqa: F401  (registers the scenario)

    records = fault_pools(world).run("full-tensors", lora_model(num_layers=1, seed=4))
    assert all(r["ok"] for r in records), records
    for r in records:
        v = r["value"]
        assert v["keys"][-3:] == ["replicated", "plain", "none"], v
        assert all(v["same"].values()), v["same"]
        assert v["shapes"]["shard3"] == [2, 5, 3] and v["shapes"]["shard7"] == [0, 3], v["shapes"]


@pytest.mark.gloo
def test_a_pool_starts_and_agrees_under_a_long_tmpdir(fault_pools, tmp_path, monkeypatch):
    """A pool folder under a long $TMPDIR: a socket file there would pass
    sun_path's 108 bytes (the pool did not start: "gloo rank 0 of 2 did not
    start"); the ranks still start and agree over the channel."""
    import tempfile

    import tests.self.rank_scenarios  # noqa: F401  (registers the scenario)
    from conformance.engine.pool import RankPool

    base = fault_pools(2)
    long_tmp = tmp_path / ("t" * 60)
    long_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    with RankPool(2, "gloo", deadline=60.0, preload=base.preload, share_server_with=base) as pool:
        assert len(os.path.join(pool._dir, "agree-1234567")) > 108
        records = pool.run("agree-on-ranks", lora_model(num_layers=1, seed=4))
    assert all(r["ok"] and r["value"]["channel"] for r in records), records


def test_where_a_rank_cannot_bind_its_socket_no_rank_has_a_channel(tmp_path, monkeypatch):
    """Off Linux the socket is a file in the pool's folder; where its path
    is too long to bind, the rank publishes no address and no rank of the
    pool makes a channel (all of them all-reduce on gloo instead)."""
    import torch.distributed as dist

    monkeypatch.setattr(agree.sys, "platform", "darwin")
    assert agree.address("/pool") == f"/pool/agree-{os.getpid()}"
    store = dist.HashStore()
    agree.setup(store, 0, 1, str(tmp_path / ("d" * 120)), 1.0)  # too long: bind fails
    assert store.get("conformance-agree/0") == b"" and agree.channel() is None
    store = dist.HashStore()
    store.set("conformance-agree/1", "")  # the other rank could not bind
    agree.setup(store, 0, 2, str(tmp_path), 1.0)
    assert store.get("conformance-agree/0") == str(tmp_path / f"agree-{os.getpid()}").encode() and agree.channel() is None
