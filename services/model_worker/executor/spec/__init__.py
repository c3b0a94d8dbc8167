"""Speculative decoding's device side: the proposers and the rejection sampler that verifies their tokens."""
