"""speculative_config, in vLLM's dict shape, checked once with a clear error per field.

Imports no torch: the scheduler and the server's frontend read it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shoal.json_arg import json_object

# What shoal can run now, and what vLLM names that shoal does not run yet.
METHODS = ("ngram", "draft_model", "mtp", "eagle", "eagle3")
NOT_YET = ("medusa", "mlp_speculator", "suffix")
# Test-only: placeholder drafts and a verifier that accepts a set share of them (timing runs
# on random weights, where real acceptance cannot be had). Never lossless.
FORCED = "test_forced_acceptance"

_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
         "acceptance_rate", "disable_by_batch_size", "adaptive_budget", "confidence_threshold",
         "forced_acceptance_rate"}
# vLLM's other keys: a clear error rather than a silently ignored setting.
_NOT_YET_KEYS = {"draft_tensor_parallel_size", "max_model_len", "quantization", "revision",
                 "code_revision", "disable_padded_drafter_batch",
                 "speculative_token_tree", "parallel_drafting", "enforce_eager"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    # mtp: drafts 1..n come from a checkpoint's first n MTP layers in a chain (n = its layer
    # count, or fewer when this is smaller), drafts past them from the last layer alone
    # (shoal/spec_decode/mtp_chain.py). vLLM has no setting for the layer count either.
    num_speculative_tokens: int
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched in the context
    prompt_lookup_max: int = 5  # ngram: longest suffix tried first
    # draft_model: the draft checkpoint; eagle: the EAGLE head's folder (mtp: none, the
    # target's own layer)
    model: str | None = None
    acceptance_rate: float = 0.0  # test_forced_acceptance only
    # No drafts while this many requests or more are running (vLLM's key; None: no limit).
    disable_by_batch_size: int | None = None
    # shoal's: per-request draft counts from recent acceptance and the batch size
    # (shoal/engine/draft_budget.py); False always verifies every draft proposed.
    adaptive_budget: bool = True
    # shoal's: confidence-scheduled verification (shoal/engine/draft_budget.py): a request
    # verifies the drafts whose cumulative drafter probability, times its acceptance
    # estimate, clears this threshold scaled up with the batch; None (default): off.
    confidence_threshold: float | None = None
    # Test-only, never lossless (timing real drafters on random weights): the method's own
    # drafter proposes and the verify forward runs as usual, then a forced share of the
    # drafts is accepted as test_forced_acceptance does, each row keeping the target's token
    # (shoal/spec_decode/forced_overlay.py). None (default): the target decides.
    forced_acceptance_rate: float | None = None

    def __post_init__(self) -> None:
        if self.method in NOT_YET:
            raise ValueError(f"speculative_config: method {self.method!r} is not supported yet "
                             f"(supported: {', '.join(METHODS)})")
        if self.method not in METHODS + (FORCED,):
            raise ValueError(f"speculative_config: unknown method {self.method!r} (one of "
                             f"{', '.join(METHODS)})")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer "
                             f">= 1 (got {k!r})")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int)) or lo < 1 or hi < lo:
                raise ValueError("speculative_config: ngram needs 1 <= prompt_lookup_min <= "
                                 f"prompt_lookup_max (got {lo!r}, {hi!r})")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (the "
                             "draft checkpoint)")
        if self.method in ("eagle", "eagle3") and not self.model:
            raise ValueError(f"speculative_config: method {self.method!r} needs 'model' (the "
                             "EAGLE head's checkpoint folder)")
        if self.method == "mtp" and self.model:
            raise ValueError("speculative_config: method 'mtp' drafts with the target's own "
                             "multi-token-prediction layer; it takes no 'model'")
        cap = self.disable_by_batch_size
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError("speculative_config: disable_by_batch_size must be an integer "
                             f">= 1 (got {cap!r})")
        if not isinstance(self.adaptive_budget, bool):
            raise ValueError("speculative_config: adaptive_budget must be true or false (got "
                             f"{self.adaptive_budget!r})")
        c = self.confidence_threshold
        if c is not None and (not isinstance(c, (int, float)) or isinstance(c, bool)
                              or not 0.0 <= c < 1.0):
            raise ValueError("speculative_config: confidence_threshold must be a number in "
                             f"[0, 1) or null (got {c!r})")
        if self.method != FORCED and self.acceptance_rate:
            raise ValueError("speculative_config: acceptance_rate is for the test-only method "
                             f"{FORCED!r}")
        f = self.forced_acceptance_rate
        if f is not None and (not isinstance(f, (int, float)) or isinstance(f, bool)
                              or not 0.0 <= f <= 1.0):
            raise ValueError("speculative_config: forced_acceptance_rate (test-only) must be a "
                             f"number in [0, 1] or null (got {f!r})")
        if f is not None and self.method == FORCED:
            raise ValueError("speculative_config: forced_acceptance_rate is for a real method; "
                             f"{FORCED!r} takes acceptance_rate")
        if self.method == FORCED and not 0.0 <= self.acceptance_rate <= 1.0:
            raise ValueError("speculative_config: acceptance_rate must be in [0, 1] (got "
                             f"{self.acceptance_rate!r})")

    @property
    def proposes_only_on_repeats(self) -> bool:
        """ngram drafts only where the context repeats itself, so a request that got no drafts
        from its last results wants none next step; the other methods always propose k."""
        return self.method == "ngram"

    @property
    def drafts_with_kv(self) -> bool:
        """The drafter keeps a paged KV cache of its own (a head or a draft model; ngram and
        the forced-acceptance test method have none)."""
        return self.method in ("draft_model", "mtp", "eagle", "eagle3")

    @classmethod
    def from_user(cls, value: Mapping[str, Any] | str) -> SpeculativeConfig:
        """From `speculative_config` as given to LLM/EngineArgs (a dict) or on the command
        line (its JSON). vLLM infers the method from the names: "ngram"/"[ngram]" as model
        means ngram, any other model means draft_model."""
        value = json_object(value, "speculative_config")
        not_yet = sorted(k for k in set(value) & _NOT_YET_KEYS if value[k] is not None)
        if not_yet:
            raise ValueError(f"speculative_config: {', '.join(not_yet)} not supported yet")
        unknown = sorted(set(value) - _KEYS - _NOT_YET_KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}")
        d = dict(value)
        method, model = d.get("method"), d.get("model")
        if method is None:
            if model in ("ngram", "[ngram]"):
                method = "ngram"
            elif model:
                method = "draft_model"
            else:
                raise ValueError("speculative_config needs 'method' (e.g. \"ngram\")")
        if method == "ngram" and model in ("ngram", "[ngram]"):
            model = None
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs 'num_speculative_tokens'")
        kwargs: dict[str, Any] = {"method": method,
                                  "num_speculative_tokens": d["num_speculative_tokens"],
                                  "model": model}
        for key in ("prompt_lookup_min", "prompt_lookup_max", "acceptance_rate",
                    "disable_by_batch_size", "adaptive_budget", "confidence_threshold",
                    "forced_acceptance_rate"):
            if d.get(key) is not None:
                kwargs[key] = d[key]
        # Only one bound given: the other takes its value (as vLLM does).
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if (lo is None) != (hi is None):
            kwargs["prompt_lookup_min"] = kwargs["prompt_lookup_max"] = lo if hi is None else hi
        return cls(**kwargs)

    def check_draft_vocab(self, target_vocab_size: int,
                          load_config: Callable[[str], Any]) -> None:
        """A draft model must share the target's vocabulary (its token ids are verified as
        the target's)."""
        if self.method != "draft_model":
            return
        assert self.model is not None
        draft_vocab = int(load_config(self.model).vocab_size)
        if draft_vocab != target_vocab_size:
            raise ValueError(f"speculative_config: the draft model {self.model!r} has another "
                             f"vocabulary ({draft_vocab} tokens) than the target "
                             f"({target_vocab_size}); they must be the same")
