"""Speculative decoding: draft proposers and the rejection sampler that verifies drafts."""
