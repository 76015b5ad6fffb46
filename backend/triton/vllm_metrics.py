"""vLLM's metric families (`vllm:*`), beside our `llm_*` ones, for vLLM's Grafana dashboards and
AIPerf's server-metrics scrape: the names, kinds, buckets and labels (model, version; no
instance label) of vllm_backend's src/utils/metrics.py, plus vLLM V1's kv_cache_usage_perc and
prefix-cache counters. Fed by Metrics (metrics.py) from the response thread.

Every replica of a model shares these series (same labels): counters and histograms add up
across replicas, the running/waiting gauges are kept as sums (each replica adds its change),
and the KV usage gauges are a fraction of one replica's pool (the one that refreshed last).
time_per_output_token is observed once per generated token after the first (vLLM's meaning):
an output that brings n tokens after a gap of t seconds is n observations of t / n.
"""
from __future__ import annotations

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
N_BUCKETS = [1, 2, 5, 10, 20]


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's build_1_2_5_buckets)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > limit:
                return out
            out.append(v)
        exp += 1


COUNTERS = {
    "vllm:prompt_tokens_total": "Number of prefill tokens processed.",
    "vllm:generation_tokens_total": "Number of generation tokens processed.",
    "vllm:num_preemptions_total": "Cumulative number of preemptions from the engine.",
    "vllm:prefix_cache_queries_total": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits_total": "Prefix cache hits, in terms of number of cached tokens.",
}
GAUGES = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:gpu_cache_usage_perc": "KV-cache usage (the name older dashboards read; CPU pools "
                                 "too). 1 means 100 percent usage.",
}
# snapshot key (metrics.engine_snapshot) -> counter fed by its increase
SNAPSHOT_COUNTERS = {"preemptions": "vllm:num_preemptions_total",
                     "prefix_cache_queries": "vllm:prefix_cache_queries_total",
                     "prefix_cache_hits": "vllm:prefix_cache_hits_total"}


class VllmMetrics:
    def __init__(self, pb, labels: dict[str, str], max_model_len: int):
        kind = pb.MetricFamily
        self._families = []
        self.counter, self.gauge, self.hist = {}, {}, {}
        hists = {
            "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.",
                                                 TTFT_BUCKETS),
            "vllm:time_per_output_token_seconds": ("Histogram of time per output token in "
                                                   "seconds.", TPOT_BUCKETS),
            "vllm:e2e_request_latency_seconds": ("Histogram of end to end request latency in "
                                                 "seconds.", E2E_BUCKETS),
            "vllm:request_prompt_tokens": ("Number of prefill tokens processed.",
                                           buckets_1_2_5(max_model_len)),
            "vllm:request_generation_tokens": ("Number of generation tokens processed.",
                                               buckets_1_2_5(max_model_len)),
            "vllm:request_params_n": ("Histogram of the n request parameter.", N_BUCKETS),
        }
        for name, (desc, buckets) in hists.items():
            fam = kind(name=name, description=desc, kind=kind.HISTOGRAM)
            self._families.append(fam)
            self.hist[name] = fam.Metric(labels=labels, buckets=buckets)
        for table, k, store in ((COUNTERS, kind.COUNTER, self.counter),
                                (GAUGES, kind.GAUGE, self.gauge)):
            for name, desc in table.items():
                fam = kind(name=name, description=desc, kind=k)
                self._families.append(fam)
                store[name] = fam.Metric(labels=labels)
        self._counts = {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0}
        self._usage: float | None = None

    # ---- response thread, per output / request --------------------------------------------
    def first_token(self, ttft: float, prompt_tokens: int) -> None:
        self.hist["vllm:time_to_first_token_seconds"].observe(ttft)
        if prompt_tokens:
            self.counter["vllm:prompt_tokens_total"].increment(prompt_tokens)

    def tokens(self, n: int, gap: float | None) -> None:
        """`n` tokens generated; `gap`: seconds since the previous token (None: the first)."""
        if n <= 0:
            return
        self.counter["vllm:generation_tokens_total"].increment(n)
        if gap is not None:
            each = gap / n
            tpot = self.hist["vllm:time_per_output_token_seconds"]
            for _ in range(n):
                tpot.observe(each)

    def request_finished(self, e2e: float | None, prompt_tokens: int, output_tokens: int) -> None:
        if e2e is None:  # refused before it ran: vLLM never sees such a request
            return
        self.hist["vllm:e2e_request_latency_seconds"].observe(e2e)
        self.hist["vllm:request_prompt_tokens"].observe(prompt_tokens)
        self.hist["vllm:request_generation_tokens"].observe(output_tokens)
        self.hist["vllm:request_params_n"].observe(1)

    # ---- engine snapshot ----------------------------------------------------------------------
    def refresh(self, snapshot: dict, increases: dict[str, float]) -> None:
        """`snapshot`: metrics.engine_snapshot's gauges; `increases`: how much each cumulative
        engine counter grew since the last refresh."""
        for key, name in SNAPSHOT_COUNTERS.items():
            if increases.get(key, 0) > 0:
                self.counter[name].increment(increases[key])
        for key, name in (("llm_num_requests_running", "vllm:num_requests_running"),
                          ("llm_num_requests_waiting", "vllm:num_requests_waiting")):
            v = snapshot.get(key)
            if v is not None and v != self._counts[name]:
                self.gauge[name].increment(v - self._counts[name])  # a sum over replicas
                self._counts[name] = v
        used, total = snapshot.get("llm_kv_cache_blocks_used"), snapshot.get(
            "llm_kv_cache_blocks_total")
        if used is not None and total:
            usage = used / total
            if usage != self._usage:
                self.gauge["vllm:kv_cache_usage_perc"].set(usage)
                self.gauge["vllm:gpu_cache_usage_perc"].set(usage)
                self._usage = usage
