"""llm_lora_requests_total{lora_name=...}: requests accepted per LoRA adapter (Prometheus, on
Triton's metrics port), with the replica's labels (model, version, instance)."""
from __future__ import annotations

NAME = "llm_lora_requests_total"


class LoraRequests:
    def __init__(self, pb, labels: dict[str, str]):
        self.labels = dict(labels)
        kind = pb.MetricFamily
        self._family = kind(name=NAME, description="Requests accepted per LoRA adapter",
                            kind=kind.COUNTER)
        self._by_name: dict[str, object] = {}

    def count(self, lora_name: str | None) -> None:
        """One request of `lora_name` (None: the base model, not counted)."""
        if lora_name is None:
            return
        m = self._by_name.get(lora_name)
        if m is None:
            m = self._by_name[lora_name] = self._family.Metric(
                labels={**self.labels, "lora_name": lora_name})
        m.increment(1)
