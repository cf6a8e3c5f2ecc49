"""Per-request sampling parameters (vLLM's field names), normalized and validated on creation.

Everything a request can get wrong is rejected here with a ValueError naming the field, so the
sampler and the engine can trust the values without re-checking them in the hot path.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from shoal.prompt_truncation import check_truncate_prompt_tokens
from shoal.structured_output.params import StructuredOutputsParams, structured_outputs_from

# vLLM's default --max-logprobs; the limit itself is an engine argument.
MAX_LOGPROBS = 20
# Below this temperature a request is treated as greedy: dividing logits by ~0 overflows.
SAMPLING_EPS = 1e-5
# torch.Generator.manual_seed accepts exactly this range (negatives are reinterpreted as u64).
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1
_LOGIT_BIAS_MAX = 100.0
# vLLM's cap on logprob_token_ids: each id is one more gathered column per step.
MAX_LOGPROB_TOKEN_IDS = 128


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(value: Any) -> bool:
    # bool is a subclass of int, but top_k=True is a client bug, not a number.
    return isinstance(value, int) and not isinstance(value, bool)


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number (got {value!r})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite (got {value})")
    return value


def _check_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer (got {value!r})")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (got {value!r})")
    return value


def _opens_thought(prompt: Sequence[int], start: int | None, end: int) -> bool:
    """The prompt's last start marker comes after its last end marker (the template opened
    the thought for the model)."""
    if start is None:
        return False
    for token in reversed(prompt):
        if token == end:
            return False
        if token == start:
            return True
    return False


def _token_id(name: str, value: Any) -> int:
    """A token id as given by a JSON client: an int or a string of digits (JSON object keys)."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{name} token ids must be integers (got {value!r})") from None
    if not _is_int(value):
        raise ValueError(f"{name} token ids must be integers (got {value!r})")
    if value < 0:
        raise ValueError(f"{name} token ids must be >= 0 (got {value})")
    return value


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1 on input) = disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    # Only these ids may be sampled (every other logit is masked to -inf).
    allowed_token_ids: list[int] | None = None
    # Report the logprobs of exactly these ids at each position (beside the sampled token's),
    # instead of the top-k; `num_logprobs` counts them.
    logprob_token_ids: list[int] | None = None
    detokenize: bool = True
    # KV offloading options, e.g. {"skip_tiers": ["disk"]}: their shape is checked here, the
    # tier names by the request validator (shoal/kv_offload/request_params.py)
    kv_transfer_params: dict[str, Any] | None = None
    # A grammar the output must follow (JSON schema, regex, choice, EBNF, structural tag)
    structured_outputs: StructuredOutputsParams | None = None
    # Reasoning models: at most this many tokens of thinking (after the start marker, or from
    # the first output token when the prompt opened it); then the end marker is forced. The
    # markers' ids come from the tokenizer's <think> / </think> unless given.
    thinking_token_budget: int | None = None
    thinking_start_token_id: int | None = None
    thinking_end_token_id: int | None = None
    # Words the output must not contain (vLLM's): the frontend tokenizes them into
    # bad_words_token_ids (engine/bad_words.py; sequences may be given there directly), and
    # a sequence's last token is banned wherever the output ends with the rest of it.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # Keep only this many prompt tokens (-1: as many as leave room for one output token),
    # dropped from the left (vLLM's generation side); a text's special tokens stay
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        self._validate_counts()
        self._validate_floats()
        self._validate_lists()
        self._validate_token_id_lists()
        self._validate_bad_words()
        self._validate_flags()
        if self.stop and not self.detokenize:  # (they match text, which is then never made)
            raise ValueError("stop strings are only supported when detokenize is True: set "
                             "detokenize=True to use stop, or stop_token_ids")
        self.kv_transfer_params = _kv_transfer_params(self.kv_transfer_params)
        self.structured_outputs = structured_outputs_from(self.structured_outputs)

    # -- validation, split by kind so each piece stays readable ---------------------------------

    def _validate_counts(self) -> None:
        if _check_int("n", self.n) < 1:
            raise ValueError(f"n must be >= 1 (got {self.n})")
        _check_int("top_k", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1 (got {self.top_k})")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not _SEED_MIN <= self.seed <= _SEED_MAX:
                raise ValueError(f"seed must be in [-2**63, 2**64 - 1] (got {self.seed})")
        if self.max_tokens is not None and _check_int("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1 or None (got {self.max_tokens})")
        if _check_int("min_tokens", self.min_tokens) < 0:
            raise ValueError(f"min_tokens must be >= 0 (got {self.min_tokens})")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens (got min_tokens={self.min_tokens}, "
                f"max_tokens={self.max_tokens})"
            )
        if self.thinking_token_budget is not None and _check_int(
                "thinking_token_budget", self.thinking_token_budget) < 0:
            raise ValueError(f"thinking_token_budget must be >= 0 (got "
                             f"{self.thinking_token_budget})")
        for name in ("thinking_start_token_id", "thinking_end_token_id"):
            if getattr(self, name) is not None and _check_int(name, getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0 (got {getattr(self, name)})")
        # The upper bound is the engine's max_logprobs (checked where requests enter the
        # engine, as vLLM does); -1 asks for the whole vocabulary.
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if _check_int(name, value) < -1:
                raise ValueError(f"{name} must be >= 0, or -1 for the whole vocabulary "
                                 f"(got {value})")

    def _validate_floats(self) -> None:
        self.temperature = _as_float("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature})")
        self.top_p = _as_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        self.min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (got {self.min_p})")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (got {value})")
            setattr(self, name, value)
        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0 (got {self.repetition_penalty})")

    def _validate_lists(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not isinstance(stop, list | tuple):
            raise ValueError(f"stop must be a string or a list of strings (got {stop!r})")
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings (got {s!r})")
            if not s:
                raise ValueError("stop strings must be non-empty (got '')")
        self.stop = list(stop)

        ids = self.stop_token_ids
        if ids is None:
            ids = []
        elif not isinstance(ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of token ids (got {ids!r})")
        self.stop_token_ids = [_token_id("stop_token_ids", t) for t in ids]

        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias (got {bias!r})")
        normalized: dict[int, float] = {}
        for key, value in bias.items():
            token = _token_id("logit_bias", key)
            value = _as_float("logit_bias", value)
            if not -_LOGIT_BIAS_MAX <= value <= _LOGIT_BIAS_MAX:
                raise ValueError(
                    f"logit_bias values must be in [-100, 100] (got {value} for token {token})"
                )
            normalized[token] = value
        self.logit_bias = normalized

    def _validate_bad_words(self) -> None:
        words = self.bad_words
        if words is not None:
            if isinstance(words, str):
                words = [words]
            if not isinstance(words, list | tuple) or not all(
                    isinstance(w, str) and w.strip() for w in words):
                raise ValueError(f"bad_words must be a list of non-empty strings (got "
                                 f"{self.bad_words!r})")
            self.bad_words = list(words)
        seqs = self.bad_words_token_ids
        if seqs is not None:
            if not isinstance(seqs, list | tuple) or not all(
                    isinstance(s, list | tuple) and s for s in seqs):
                raise ValueError("bad_words_token_ids must be a list of non-empty token id "
                                 f"lists (got {seqs!r})")
            self.bad_words_token_ids = [[_token_id("bad_words_token_ids", t) for t in s]
                                        for s in seqs]

    def _validate_token_id_lists(self) -> None:
        for name in ("allowed_token_ids", "logprob_token_ids"):
            ids = getattr(self, name)
            if ids is None:
                continue
            if not isinstance(ids, list | tuple):
                raise ValueError(f"{name} must be a list of token ids (got {ids!r})")
            if not ids:
                raise ValueError(f"{name} must not be empty (leave it unset instead)")
            setattr(self, name, [_token_id(name, t) for t in ids])
        ids = self.logprob_token_ids
        if ids is None:
            return
        if len(ids) > MAX_LOGPROB_TOKEN_IDS:
            raise ValueError(f"logprob_token_ids must list at most {MAX_LOGPROB_TOKEN_IDS} "
                             f"token ids (got {len(ids)})")
        if self.logprobs is not None and self.logprobs != len(ids):
            raise ValueError(
                "logprob_token_ids must list as many ids as logprobs when both are set "
                f"(got logprobs={self.logprobs} and {len(ids)} ids)")

    def _validate_flags(self) -> None:
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
            "detokenize",
        ):
            _check_bool(name, getattr(self, name))

    # -- derived views ---------------------------------------------------------------------------

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def num_logprobs(self) -> int | None:
        """Logprob entries per generated position besides the sampled token (None: no
        logprobs): `logprobs`, or how many ids `logprob_token_ids` lists."""
        if self.logprobs is not None:
            return self.logprobs
        return len(self.logprob_token_ids) if self.logprob_token_ids else None

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    @property
    def needs_output_history(self) -> bool:
        """Sampling reads every token produced so far (penalties, min_tokens), so the next
        step cannot be prepared before this one's token is known. (A grammar needs only the
        last token: the engine core advances it while the next step's forward runs.)"""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or self.min_tokens > 0
                or self.thinking_token_budget is not None
                or any(len(w) > 1 for w in self.bad_words_token_ids or ()))

    def thinking_forced(self, output_token_ids: Sequence[int],
                        prompt_token_ids: Sequence[int] = ()) -> int | None:
        """The end marker when the thinking budget is spent and thinking has not ended; else
        None. The thought is what follows the output's last start marker, or the whole
        output when the prompt opened one (its last <think> after its last </think>); with
        neither, nothing is thinking."""
        budget, end = self.thinking_token_budget, self.thinking_end_token_id
        if budget is None or end is None or end in output_token_ids:
            return None
        start = self.thinking_start_token_id
        if start is not None and start in output_token_ids:
            thought = output_token_ids[::-1].index(start)  # tokens after its last one
        elif _opens_thought(prompt_token_ids, start, end):
            thought = len(output_token_ids)
        else:
            return None
        return end if thought >= budget else None

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def for_sample(self, index: int) -> SamplingParams:
        """Params for the index-th of the n samples of a request, run as its own sequence.

        Seeds are offset by index so the n samples differ from each other yet the whole
        request stays reproducible for a given seed.
        """
        if not _is_int(index) or not 0 <= index < self.n:
            raise ValueError(f"index must be in [0, n={self.n}) (got {index!r})")
        seed = self.seed
        if seed is not None:
            seed += index
            if seed > _SEED_MAX:  # wrap like the generator's own u64 arithmetic
                seed -= 2**64
        child = self.clone()
        return dataclasses.replace(child, n=1, seed=seed)

    def validate_against_vocab(self, vocab_size: int) -> None:
        """Reject token ids the model cannot produce (they would index past the logits row)."""
        for token in self.logit_bias or {}:
            if token >= vocab_size:
                raise ValueError(f"logit_bias token id {token} is out of range [0, {vocab_size})")
        for name in ("stop_token_ids", "allowed_token_ids", "logprob_token_ids"):
            for token in getattr(self, name) or []:
                if token >= vocab_size:
                    raise ValueError(
                        f"{name} token id {token} is out of range [0, {vocab_size})")
        for token in (t for word in self.bad_words_token_ids or () for t in word):
            if token >= vocab_size:
                raise ValueError(f"bad_words_token_ids token id {token} is out of range "
                                 f"[0, {vocab_size})")


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters (`LLM.beam_search`, `use_beam_search` on the server).

    Beam search runs in the frontend (shoal/beam_search.py): each step is one 1-token request
    per live beam asking for the top 2 * beam_width logprobs."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    # Picks each step's sampled token only; beams are ranked by the raw logprobs.
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if _check_int("beam_width", self.beam_width) < 1:
            raise ValueError(f"beam_width must be >= 1 (got {self.beam_width})")
        if _check_int("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1 (got {self.max_tokens})")
        self.temperature = _as_float("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature})")
        self.length_penalty = _as_float("length_penalty", self.length_penalty)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check_bool(name, getattr(self, name))

    def step_params(self) -> SamplingParams:
        """What each beam's one-token request asks of the engine."""
        return SamplingParams(temperature=self.temperature, max_tokens=1,
                              logprobs=2 * self.beam_width, detokenize=False)


# skip_tiers: KV offloading; the rest: prefill/decode disaggregation (shoal/kv_transfer/p2p.py)
_KV_TRANSFER_KEYS = ("skip_tiers", "do_remote_decode", "do_remote_prefill", "remote_host",
                     "remote_port", "remote_request_id", "remote_num_tokens", "remote_engine_id")


def _kv_transfer_params(params: Any) -> dict[str, Any] | None:
    """kv_transfer_params checked for shape and normalized (skip_tiers sorted, no repeats)."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be a dict (got {params!r})")
    unknown = sorted(set(params) - set(_KV_TRANSFER_KEYS))
    if unknown:
        raise ValueError(f"kv_transfer_params: unknown key(s) {', '.join(map(str, unknown))}; "
                         f"known: {', '.join(_KV_TRANSFER_KEYS)}")
    skip = params.get("skip_tiers", [])
    if (isinstance(skip, str) or not isinstance(skip, list | tuple | set | frozenset)
            or not all(isinstance(t, str) for t in skip)):
        raise ValueError(f"kv_transfer_params.skip_tiers must be a list of tier names (got "
                         f"{skip!r})")
    out = {k: v for k, v in params.items() if k != "skip_tiers"}
    for flag in ("do_remote_decode", "do_remote_prefill"):
        if not isinstance(out.get(flag, False), bool):
            raise ValueError(f"kv_transfer_params.{flag} must be true or false")
    if out.get("do_remote_prefill") and not (
            isinstance(out.get("remote_host"), str) and type(out.get("remote_port")) is int
            and isinstance(out.get("remote_request_id"), str)):
        raise ValueError("kv_transfer_params: do_remote_prefill needs remote_host (a string), "
                         "remote_port (an integer) and remote_request_id (a string)")
    if skip or not out:
        out["skip_tiers"] = sorted(set(skip))
    return out
