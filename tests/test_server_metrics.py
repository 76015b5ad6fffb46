"""client.server.Server.settled_metrics, the integration tests' read of counters that the model
refreshes from its engine: the values of one scrape once scrapes stop changing."""
from __future__ import annotations

import pytest

from client.server import Server


class Scrapes:
    """Stands in for a server's /metrics: each metrics() call returns the next scrape."""

    def __init__(self, *scrapes: dict[str, float]):
        self.scrapes, self.calls = list(scrapes), 0

    def metrics(self, prefix: str = "llm_") -> dict[str, float]:
        got = self.scrapes[min(self.calls, len(self.scrapes) - 1)]
        self.calls += 1
        return got


def test_settled_metrics_waits_for_two_equal_scrapes_and_sums_labels():
    drafted, accepted = "llm_spec_draft_tokens_total", "llm_spec_accepted_tokens_total"
    stale = {f'{drafted}{{model="llm"}}': 41.0, f'{accepted}{{model="llm"}}': 30.0}
    fresh = {f'{drafted}{{model="llm",i="0"}}': 60.0, f'{drafted}{{model="llm",i="1"}}': 20.0,
             f'{accepted}{{model="llm"}}': 70.0}
    server = Scrapes(stale, fresh, fresh)
    got = Server.settled_metrics(server, (drafted, accepted), quiet=0)
    assert got == {drafted: 80.0, accepted: 70.0} and server.calls == 3


def test_settled_metrics_names_a_series_that_is_not_exported():
    server = Scrapes({'llm_engine_steps_total{model="llm"}': 3.0})
    with pytest.raises(KeyError, match="llm_cold_path_events_total"):
        Server.settled_metrics(server, ("llm_engine_steps_total", "llm_cold_path_events_total"),
                               quiet=0)
