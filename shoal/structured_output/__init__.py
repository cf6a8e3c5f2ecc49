"""Structured outputs: constraints on a request's output enforced by a grammar engine
(params.py: what a request asks, torch-free; manager.py: compilation and bitmasks in the
engine core; bitmask.py: masking the logits), and the tool-call / reasoning parsers of the
chat frontend."""
