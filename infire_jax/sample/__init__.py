"""Sampling: a request's parameters, the device sampler, and prompt logprobs."""
