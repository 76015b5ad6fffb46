"""Custom Triton metrics of one replica (served on Triton's metrics port, Prometheus text format).

All carry the labels model, version and instance. `pb` is triton_python_backend_utils (a fake in
unit tests); each metric call is an IPC to the server, so the llm_* families observe
nothing per token: latencies once per request, gauges and engine counters from a snapshot every
`interval` seconds. The vLLM families (vllm_metrics.py, parameter vllm_metrics) observe
time_per_output_token once per token, as vLLM does.
"""
from __future__ import annotations

import time

TTFT_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.5, 1.0, 2.5]
E2E_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0]

HISTOGRAMS = {
    "llm_time_to_first_token_seconds": ("Time from request arrival to its first token", TTFT_BUCKETS),
    "llm_inter_token_latency_seconds": ("A request's mean time between consecutive output "
                                        "tokens, (last - first) / (tokens - 1), observed once "
                                        "per request (per token: "
                                        "vllm:time_per_output_token_seconds)", ITL_BUCKETS),
    "llm_e2e_request_latency_seconds": ("Time from request arrival to its final response", E2E_BUCKETS),
}
COUNTERS = {
    "llm_prompt_tokens_total": "Prompt tokens of finished requests",
    "llm_generation_tokens_total": "Generated tokens of finished requests",
    "llm_engine_steps_total": "Engine steps (one forward pass each)",
    "llm_engine_sampled_tokens_total": "Tokens appended by engine steps (per-step batch sizes "
                                       "summed; accepted speculative drafts included)",
    "llm_engine_scheduled_tokens_total": "Tokens run through the model by engine steps (prompt "
                                         "chunks, decode rows, draft tokens)",
    "llm_preemptions_total": "Sequences preempted for lack of KV blocks",
    "llm_cold_path_events_total": "Work after READY that warmup should have done (steady state: 0)",
    "llm_model_seconds_total": "Engine time in steps: scheduling, input prep and forward passes",
    "llm_collective_seconds_total": "Part of llm_model_seconds_total spent in tensor-parallel "
                                    "collectives (rank 0's view: waiting for a slower rank counts)",
    "llm_prefix_cache_queries_total": "Tokens of requests looked up in the prefix cache when "
                                      "they joined the batch (a recompute after preemption again)",
    "llm_prefix_cache_hits_total": "Of llm_prefix_cache_queries_total, tokens served from cached "
                                   "KV blocks (hit rate: hits / queries)",
    "llm_spec_draft_tokens_total": "Speculative decoding: n-gram draft tokens verified",
    "llm_spec_accepted_tokens_total": "Of llm_spec_draft_tokens_total, drafts the model agreed "
                                      "with (tokens that took no step of their own)",
    "llm_tp_group_rebuilds_total": "Tensor-parallel groups rebuilt after a rank was lost",
}
GAUGES = {
    "llm_num_requests_running": "Requests in the running batch",
    "llm_num_requests_waiting": "Requests waiting to be scheduled",
    "llm_kv_cache_blocks_used": "KV cache blocks in use",
    "llm_kv_cache_blocks_total": "KV cache blocks in the pool",
}
REQUESTS = "llm_requests_total"  # counter labelled by finish reason (stop, length, abort, error, invalid)


class Metrics:
    def __init__(self, pb, labels: dict[str, str], interval: float = 0.1, vllm=None):
        self.labels, self.interval = dict(labels), interval
        self.vllm = vllm  # a vllm_metrics.VllmMetrics, or None (parameter vllm_metrics false)
        kind = pb.MetricFamily
        self._families = []  # keep families alive longer than their metrics
        self.hist, self.counter, self.gauge = {}, {}, {}
        for name, (desc, buckets) in HISTOGRAMS.items():
            fam = kind(name=name, description=desc, kind=kind.HISTOGRAM)
            self._families.append(fam)
            self.hist[name] = fam.Metric(labels=self.labels, buckets=buckets)
        for name, desc in COUNTERS.items():
            fam = kind(name=name, description=desc, kind=kind.COUNTER)
            self._families.append(fam)
            self.counter[name] = fam.Metric(labels=self.labels)
        for name, desc in GAUGES.items():
            fam = kind(name=name, description=desc, kind=kind.GAUGE)
            self._families.append(fam)
            self.gauge[name] = fam.Metric(labels=self.labels)
        self._req_family = kind(name=REQUESTS, description="Finished requests by finish reason",
                                kind=kind.COUNTER)
        self._by_reason: dict[str, object] = {}
        self._last_gauges: dict[str, float] = {}
        self._last_engine: dict[str, float] = {}
        self._next_refresh = 0.0

    # ---- per request (response thread) ------------------------------------------------------
    def observe_ttft(self, seconds: float, prompt_tokens: int = 0) -> None:
        self.hist["llm_time_to_first_token_seconds"].observe(seconds)
        if self.vllm:
            self.vllm.first_token(seconds, prompt_tokens)

    def observe_tokens(self, n: int, gap: float | None) -> None:
        """`n` new tokens on one engine output, `gap` seconds after the previous token (None
        for the request's first)."""
        if self.vllm:
            self.vllm.tokens(n, gap)

    def observe_itl(self, seconds: float) -> None:
        self.hist["llm_inter_token_latency_seconds"].observe(seconds)

    def request_finished(self, reason: str, e2e: float | None, prompt_tokens: int,
                         output_tokens: int) -> None:
        if e2e is not None:
            self.hist["llm_e2e_request_latency_seconds"].observe(e2e)
        if prompt_tokens:
            self.counter["llm_prompt_tokens_total"].increment(prompt_tokens)
        if output_tokens:
            self.counter["llm_generation_tokens_total"].increment(output_tokens)
        m = self._by_reason.get(reason)
        if m is None:
            m = self._by_reason[reason] = self._req_family.Metric(
                labels={**self.labels, "finish_reason": reason})
        m.increment(1)
        if self.vllm:
            self.vllm.request_finished(e2e, prompt_tokens, output_tokens)

    # ---- engine snapshot (response thread, rate-limited) ------------------------------------
    def refresh(self, snapshot: dict[str, float], force: bool = False) -> None:
        """`snapshot`: the GAUGES names and, for counters, cumulative engine totals
        (steps, sampled_tokens, scheduled_tokens, preemptions, cold_path, model_seconds,
        collective_seconds, prefix_cache_queries, prefix_cache_hits, spec_draft_tokens,
        spec_accepted_tokens, recoveries)."""
        now = time.monotonic()
        if not force and now < self._next_refresh:
            return
        self._next_refresh = now + self.interval
        increases: dict[str, float] = {}
        for name in GAUGES:
            v = snapshot.get(name)
            if v is not None and self._last_gauges.get(name) != v:
                self.gauge[name].set(v)
                self._last_gauges[name] = v
        for key, name in (("steps", "llm_engine_steps_total"),
                          ("sampled_tokens", "llm_engine_sampled_tokens_total"),
                          ("scheduled_tokens", "llm_engine_scheduled_tokens_total"),
                          ("preemptions", "llm_preemptions_total"),
                          ("cold_path", "llm_cold_path_events_total"),
                          ("model_seconds", "llm_model_seconds_total"),
                          ("collective_seconds", "llm_collective_seconds_total"),
                          ("prefix_cache_queries", "llm_prefix_cache_queries_total"),
                          ("prefix_cache_hits", "llm_prefix_cache_hits_total"),
                          ("spec_draft_tokens", "llm_spec_draft_tokens_total"),
                          ("spec_accepted_tokens", "llm_spec_accepted_tokens_total"),
                          ("recoveries", "llm_tp_group_rebuilds_total")):
            v = snapshot.get(key)
            if v is None:
                continue
            delta = v - self._last_engine.get(key, 0)
            if delta > 0:
                self.counter[name].increment(delta)
                increases[key] = delta
            self._last_engine[key] = v
        if self.vllm:
            self.vllm.refresh(snapshot, increases)


class NullMetrics:
    """enable_metrics false: the same interface, no effect."""

    def observe_ttft(self, seconds, prompt_tokens=0): pass
    def observe_tokens(self, n, gap): pass
    def observe_itl(self, seconds): pass
    def request_finished(self, reason, e2e, prompt_tokens, output_tokens): pass
    def refresh(self, snapshot, force=False): pass


def engine_snapshot(engine) -> dict[str, float]:
    """Gauges and cumulative counters read from an LLMEngine owned by another thread: reads of
    list lengths and ints only (atomic under the GIL; a value may be one step old)."""
    sched, kv, stats = engine.scheduler, engine.kv, engine.stats
    # accepted before drafted: the engine counts a verify step's drafts, then what it accepted,
    # so read in this order the pair never shows more accepted than drafted
    spec_accepted = stats.spec_accepted_tokens
    spec_drafted = stats.spec_draft_tokens
    return {
        "llm_num_requests_running": len(sched.running),
        "llm_num_requests_waiting": len(sched.waiting),
        "llm_kv_cache_blocks_used": kv.num_used_blocks,
        "llm_kv_cache_blocks_total": kv.num_blocks,
        "steps": stats.steps, "sampled_tokens": stats.sampled_tokens,
        "scheduled_tokens": stats.scheduled_tokens, "preemptions": stats.preemptions,
        "cold_path": cold.total if (cold := getattr(engine, "cold_path", None)) else None,
        "model_seconds": stats.model_seconds, "collective_seconds": stats.collective_seconds,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "spec_draft_tokens": spec_drafted, "spec_accepted_tokens": spec_accepted,
        "recoveries": stats.recoveries,
    }
