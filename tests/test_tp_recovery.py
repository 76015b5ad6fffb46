"""A tensor-parallel worker dies: requests in flight fail fast and clearly, the group is rebuilt,
serving resumes, and no process is left behind."""
from __future__ import annotations

import os
import signal
import time

import pytest

from backend import LLM, AsyncEngine, SamplingParams
from backend.engine.llm_engine import LLMEngine
from tests.test_tp import _pids_alive
from tests.tiny_models import make_tiny_checkpoint


def test_worker_death_fails_in_flight_then_recovers(tmp_path):
    make_tiny_checkpoint("llama", tmp_path, layers=4)
    llm = LLM(model=str(tmp_path), tensor_parallel_size=2, num_kv_blocks=128, block_size=8)
    engine = AsyncEngine(llm.engine)
    old = llm.engine.group.worker_pids
    try:
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        want = [t for o in engine.add_request("before", list(range(5, 30)), sp) for t in o.token_ids]
        long = engine.add_request("victim", list(range(5, 40)), SamplingParams(
            max_tokens=900, ignore_eos=True))
        long.get(timeout=30)
        os.kill(old[0], signal.SIGKILL)
        killed = time.monotonic()
        last = [o for o in long][-1]
        # Found by the collectives' liveness checks, not their 60 s timeout. The bound leaves a
        # loaded 2-core machine time to reap the killed process (is_alive() waits for that).
        assert time.monotonic() - killed < 5.0
        assert last.finished and last.finish_reason == "error"
        assert "peer" in last.error.lower() or "worker" in last.error.lower()
        deadline = killed + 30
        while time.monotonic() < deadline and llm.engine.stats.recoveries == 0:
            time.sleep(0.1)
        assert llm.engine.stats.recoveries == 1
        again = [t for o in engine.add_request("after", list(range(5, 30)), sp) for t in o.token_ids]
        assert again == want
        assert time.monotonic() - killed < 30
        new = llm.engine.group.worker_pids
        assert new != old and _pids_alive(old) == [] and len(_pids_alive(new)) == 1
    finally:
        engine.shutdown()
        llm.close()
    assert _pids_alive(llm.engine.group.worker_pids) == []


def test_failed_step_needs_recovery_even_while_channels_look_open():
    """A killed rank's sockets close one by one as it exits: the collective can fail while its
    step channel still reads as open. The failed step alone marks the group for a rebuild."""
    class Group:
        closed, step_failed = False, False

        def workers_alive(self):
            return True  # every channel still looks open

        def broadcast(self, step):
            pass

    class Runner:
        def forward(self, inputs):
            raise RuntimeError("Connection reset by peer")

    engine = object.__new__(LLMEngine)  # only run_model / needs_recovery are exercised
    engine.group, engine.runner = Group(), Runner()
    assert not engine.needs_recovery
    with pytest.raises(RuntimeError, match="reset"):
        engine.run_model(None)
    assert engine.needs_recovery
