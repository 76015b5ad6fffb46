"""A lost tensor-parallel rank as the requests' error (backend/engine/lost_rank.py): the rank and
host named, the rebuild announced, no library source paths; a group across hosts refuses new
requests while it is rebuilt; the rebuilds are counted in the llm_* metrics."""
from __future__ import annotations

import threading
import time
from multiprocessing.connection import Client, Listener

import pytest

from backend.engine.async_engine import AsyncEngine
from backend.engine.lost_rank import (LostRanks, clean, find_lost, rebuild_notice, step_error)
from backend.engine.outputs import RequestOutput
from backend.engine.request_check import PreparedRequest
from backend.engine.sampling.sampling_params import SamplingParams
from backend.engine.stats import EngineStats
from backend.engine.tp.channel import peer_host
from backend.parallel.shm_comm import PeerLostError
from backend.triton.metrics import Metrics, engine_snapshot
from tests.idle_engine import idle_engine
from tests.test_triton_responder import FakePB

# what torch's gloo said when the remote launcher was killed mid-stream (the report)
GLOO_READ_ERROR = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
                   "Read error [10.1.2.3]:41873: Connection reset by peer")


class FakeGroup:
    """The TPGroup surface lost_rank.py reads; `lost` shows after `shows_after` seconds."""

    def __init__(self, world=2, local_ranks=1, lost=None, shows_after=0.0, hosts=None):
        self.world, self.local_ranks = world, local_ranks
        self.step_failed = True
        self.remote_hosts = hosts if hosts is not None else {1: "10.1.2.3"}
        self._lost, self._t = dict(lost or {}), time.monotonic() + shows_after

    def lost_ranks(self):
        return dict(self._lost) if time.monotonic() >= self._t else {}


def _no_internals(msg: str) -> None:
    for bad in ("/__w/", "pair.cc", "gloo", "third_party", "Traceback"):
        assert bad not in msg, msg


def test_no_group_keeps_the_step_error():
    msg, lost = step_error(None, ValueError("boom"))
    assert msg == "engine step failed: boom" and lost is None
    group = FakeGroup(lost={1: "h"})
    group.step_failed = False  # failed before any rank was involved (e.g. the scheduler)
    assert step_error(group, ValueError("boom"))[0] == "engine step failed: boom"


def test_lost_remote_rank_named_with_its_host():
    msg, lost = step_error(FakeGroup(lost={1: "10.1.2.3"}), RuntimeError(GLOO_READ_ERROR), 0)
    assert msg == ("tensor-parallel rank 1 (the worker on host 10.1.2.3) was lost; the "
                   "tensor-parallel group is being rebuilt; retry the request")
    assert lost == LostRanks({1: "10.1.2.3"}, remote=True)
    _no_internals(msg)


def test_lost_rank_that_shows_late_is_waited_for():
    """A killed rank's channel can read as open for a moment after its collective failed."""
    group = FakeGroup(world=3, local_ranks=1, lost={1: "a", 2: "b"}, shows_after=0.3)
    t0 = time.monotonic()
    msg, _ = step_error(group, PeerLostError("rank 0: a peer rank died during collective 7"), 5.0)
    assert time.monotonic() - t0 < 4.0  # returned when it showed, not at the deadline
    assert msg.startswith("tensor-parallel ranks 1 (the worker on host a) and 2 (the worker on "
                          "host b) were lost;")
    assert "collective 7" not in msg


def test_silent_rank_named_from_the_peer_address():
    """Nothing shows as gone (a host vanished, its sockets still open): the gloo error's peer
    address names the remote rank that joined from there."""
    group = FakeGroup(world=3, local_ranks=1, hosts={1: "10.9.9.9", 2: "10.1.2.3"})
    msg, lost = step_error(group, RuntimeError(GLOO_READ_ERROR), wait_s=0.1)
    assert msg.startswith("tensor-parallel rank 2 (the worker on host 10.1.2.3) was lost;")
    assert lost.ranks == {2: "10.1.2.3"}
    _no_internals(msg)


def test_unknown_peer_and_timeout_still_clear():
    group = FakeGroup(hosts={})
    msg, lost = step_error(group, RuntimeError(GLOO_READ_ERROR), wait_s=0)
    assert msg == ("a collective failed (its connection to host 10.1.2.3 broke): a rank stopped "
                   "answering; the tensor-parallel group is being rebuilt; retry the request")
    assert lost.ranks == {} and lost.remote
    _no_internals(msg)
    msg, _ = step_error(group, RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms "
        "for recv operation to complete"), wait_s=0)
    assert msg.startswith("a collective failed: a rank stopped answering;")
    _no_internals(msg)


def test_rank0_own_error_kept_without_source_paths():
    msg, _ = step_error(FakeGroup(), ValueError("[/src/model.py:12] bad shape (3, 4)"), wait_s=0)
    assert msg == ("engine step failed: bad shape (3, 4); the tensor-parallel group is being "
                   "rebuilt; retry the request")
    assert clean("x [a/b.cc:1] y") == "x y"


def test_only_groups_across_hosts_refuse_during_the_rebuild():
    assert rebuild_notice(None) is None
    assert rebuild_notice(LostRanks({1: "here"}, remote=False)) is None
    notice = rebuild_notice(LostRanks({1: "10.1.2.3"}, remote=True))
    assert "rank 1 (the worker on host 10.1.2.3) was lost" in notice and "being rebuilt" in notice
    assert "rank stopped answering" in rebuild_notice(LostRanks({}, remote=True))


def test_find_lost_one_host_group():
    lost = find_lost(FakeGroup(world=2, local_ranks=2, lost={1: "node-a"}), wait_s=0)
    assert lost == LostRanks({1: "node-a"}, remote=False)


def test_peer_host_of_a_step_channel():
    with Listener(("127.0.0.1", 0), authkey=b"k" * 16) as listener:
        client: list = []
        t = threading.Thread(target=lambda: client.append(
            Client(listener.address, authkey=b"k" * 16)))
        t.start()
        conn = listener.accept()
        t.join(10)
        assert peer_host(conn) == "127.0.0.1"
        conn.close()
        client[0].close()


# ---- the engine thread: the failure, the refusal, serving again -----------------------------
class FakeEngine:
    """The LLMEngine surface AsyncEngine drives: one request in flight whose step fails as a
    remote rank's death does; recover() blocks until the test lets it finish."""

    def __init__(self, group: FakeGroup):
        self.group = group
        group.step_failed = False  # until the step meets the dead rank (as run_model sets it)
        self.requests: dict[str, PreparedRequest] = {}
        self.rebuilding, self.release = threading.Event(), threading.Event()
        self.fail_next = True
        self.recoveries = 0

    def prepare_request(self, rid, prompt, params):
        return PreparedRequest(rid, list(prompt), params or SamplingParams())

    def add_request(self, rid, req):
        self.requests[rid] = req

    def has_unfinished(self):
        return bool(self.requests)

    @property
    def needs_recovery(self):
        return self.group.step_failed

    def step(self):
        if self.fail_next:
            self.fail_next = False
            self.group.step_failed = True
            raise RuntimeError(GLOO_READ_ERROR)
        outs = [RequestOutput(rid, "", [7], True, "length", 1, 1) for rid in self.requests]
        self.requests.clear()
        return outs

    def abort_all(self, reason="abort", error=None):
        outs = [RequestOutput(rid, "", [], True, reason, 1, 0, error=error)
                for rid in self.requests]
        self.requests.clear()
        return outs

    def abort_request(self, rid):
        return None

    def recover(self):
        self.rebuilding.set()
        assert self.release.wait(30)
        self.group.step_failed = False
        self.recoveries += 1


def test_engine_fails_the_stream_refuses_meanwhile_then_serves():
    group = FakeGroup(lost={1: "10.1.2.3"})
    fake = FakeEngine(group)
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    try:
        stream = engine.add_request("a", [1, 2, 3])
        last = [o for o in stream][-1]
        assert last.finish_reason == "error"
        assert last.error.startswith(
            "tensor-parallel rank 1 (the worker on host 10.1.2.3) was lost;")
        _no_internals(last.error)
        assert fake.rebuilding.wait(10)
        with pytest.raises(RuntimeError, match=r"rank 1 \(the worker on host 10.1.2.3\) was "
                                               r"lost; the tensor-parallel group is being rebuilt"):
            engine.add_request("b", [1, 2, 3])
        fake.release.set()
        deadline = time.monotonic() + 10
        while True:  # refused until the rebuild ends, then served
            try:
                stream = engine.add_request("c", [1, 2, 3])
                break
            except RuntimeError:
                assert time.monotonic() < deadline, "still refused after the rebuild"
                time.sleep(0.02)
        assert [o for o in stream][-1].finish_reason == "length"
        assert fake.recoveries == 1
    finally:
        fake.release.set()
        engine.shutdown()


def test_rebuilds_counted_in_metrics():
    engine = idle_engine(EngineStats())
    metrics = Metrics(FakePB, {"model": "llm"}, interval=0)
    engine.stats.recoveries = 1
    metrics.refresh(engine_snapshot(engine))
    engine.stats.recoveries = 3
    metrics.refresh(engine_snapshot(engine))
    assert metrics.counter["llm_tp_group_rebuilds_total"].value == 3
