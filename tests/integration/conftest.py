"""Fixtures that run the real tritonserver (via `python -m backend.serve`, see client/server.py)
on free ports with a temporary copy of model_repository/ (parameters overridden), and always
kill it at teardown."""
from __future__ import annotations

import pytest

from client.server import ROOT, Server, free_ports, make_repo  # noqa: F401 (used by tests)
# Small pools and one thread per replica keep the shared 2-core machine responsive.
BASE_PARAMS = {"kv_cache_memory_gb": "0.125", "max_num_seqs": "16", "num_threads": "2"}
NO_WARMUP = {"warmup": "false"}  # servers that test placement/shutdown, not step shapes


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """start_server(name, params=..., count=..., extra=...) -> a ready Server, stopped at the end
    of the session (or by the test)."""
    servers: list[Server] = []

    def start(name: str, params: dict | None = None, count: int = 1, extra=()) -> Server:
        d = tmp_path_factory.mktemp(name)
        repo = make_repo(d / "repo", {**BASE_PARAMS, **(params or {})}, count)
        srv = Server(repo, d / "server.log", list(extra))
        servers.append(srv)
        srv.wait_ready()
        return srv

    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="session")
def server(start_server):
    """The shared one-replica server (warmed up, as served)."""
    return start_server("shared")


@pytest.fixture(scope="session")
def offline():
    """The engine in this process, with the shared server's settings: the greedy reference."""
    from backend import LLM
    llm = LLM(num_threads=2, kv_cache_memory_gb=0.125, max_num_seqs=16, warmup=False)
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def greedy(offline):
    """greedy(prompt, max_tokens, ignore_eos=False) -> the offline text (cached);
    greedy.many(prompts, max_tokens, ignore_eos=False) -> their texts, run as one batch."""
    from backend import SamplingParams
    cache: dict = {}

    def many(prompts: list[str], max_tokens: int, ignore_eos: bool = False) -> list[str]:
        todo = [p for p in dict.fromkeys(prompts) if (p, max_tokens, ignore_eos) not in cache]
        if todo:
            outs = offline.generate(todo, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                         ignore_eos=ignore_eos))
            for p, o in zip(todo, outs):
                cache[(p, max_tokens, ignore_eos)] = o.text
        return [cache[(p, max_tokens, ignore_eos)] for p in prompts]

    def run(prompt: str, max_tokens: int, ignore_eos: bool = False) -> str:
        return many([prompt], max_tokens, ignore_eos)[0]
    run.many = many
    return run
