"""Speculative decoding's drafters (shoal/worker/drafter.py is the interface they implement):
ngram prompt lookup, a draft model, the hidden-state heads of MTP and EAGLE, and the test-only
forced acceptance; factory.py builds the one a speculative config asks for. Verification is
the rejection sampler's, in shoal/sample/."""
