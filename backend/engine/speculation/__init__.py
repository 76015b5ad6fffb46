"""Speculative decoding: the n-gram drafter, the speculator policy and the step-cost table."""
