"""Sampling: the per-request parameters, the sampler, logprobs and structured output."""
