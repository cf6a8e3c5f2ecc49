"""Benchmark request sets: random, ShareGPT (a local JSON file) and prefix repetition.

The flags and their defaults are vLLM's (`vllm bench serve` / `throughput`), so one command
line means the same requests on both. Differences, all opt-in: `--token-id-prompts` sends
the random / prefix-repetition prompts as token ids (exact lengths, no tokenizer needed, as
the W1/W8 workloads define them), and presets may set exact length ranges and a token-id range
(`RandomSpec.input_range`, `token_range`).

Random prompts as text: draw token ids, decode them, encode the text again and adjust (trim,
or append fresh random ids) until the text encodes to exactly the wanted length, since a
tokenizer need not map decode(ids) back to the same number of ids.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

DATASETS = ("random", "sharegpt", "prefix_repetition")


@dataclass
class SampleRequest:
    prompt: str | list[int]  # text, or token ids
    prompt_len: int
    expected_output_len: int
    request_id: str = ""


@dataclass
class RandomSpec:
    """Lengths are drawn integer-uniform from the closed ranges."""

    input_range: tuple[int, int]
    output_range: tuple[int, int]
    prefix_len: int = 0
    token_range: tuple[int, int] | None = None  # [low, high) of token ids; None: the vocab
    token_ids: bool = False  # send ids, not text
    # Draw as nano-vllm's bench.py does (Python's random, its order of draws), so W1 is the
    # very request set that bench reports (133,966 output tokens at seed 0).
    nano_vllm_draws: bool = False

    @classmethod
    def from_ratio(cls, input_len: int, output_len: int, range_ratio: float = 0.0,
                   prefix_len: int = 0, **kw: Any) -> RandomSpec:
        """vLLM's form: [floor(L*(1-r)), ceil(L*(1+r))], output at least 1."""
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
        lo = math.floor(input_len * (1 - range_ratio))
        hi = math.ceil(input_len * (1 + range_ratio))
        olo = max(1, math.floor(output_len * (1 - range_ratio)))
        ohi = max(1, math.ceil(output_len * (1 + range_ratio)))
        if prefix_len + lo < 1:
            raise ValueError("--random-input-len is too small: a prompt would be empty")
        return cls((lo, hi), (olo, ohi), prefix_len, **kw)


@dataclass
class PrefixRepetitionSpec:
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    output_len: int = 128
    token_ids: bool = False


@dataclass
class ShareGPTSpec:
    path: str
    output_len: int | None = None  # fixed output length instead of the dataset's
    oversample: bool = True
    shuffle: bool = True


def _allowed_ids(tokenizer: Any, token_range: tuple[int, int] | None) -> np.ndarray:
    if token_range is not None:
        low, high = token_range
        if not 0 <= low < high:
            raise ValueError(f"bad token id range [{low}, {high})")
        ids = np.arange(low, high)
    else:
        if tokenizer is None:
            raise ValueError("random prompts need a tokenizer or a token id range")
        ids = np.arange(tokenizer.vocab_size)
    if tokenizer is not None:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        if special:
            ids = ids[~np.isin(ids, list(special))]
    return ids


def _text_of_length(tokenizer: Any, ids: list[int], target: int, allowed: np.ndarray,
                    rng: np.random.Generator, tries: int = 10) -> tuple[str, int]:
    """Text that encodes to `target` tokens (or as close as `tries` rounds get)."""
    text = tokenizer.decode(ids)
    for _ in range(tries):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target:
            break
        if len(ids) > target:
            ids = ids[:target]
        else:
            ids = ids + allowed[rng.integers(0, len(allowed), target - len(ids))].tolist()
        text = tokenizer.decode(ids)
    n = len(tokenizer.encode(text, add_special_tokens=False))
    return text, n


def _nano_vllm_requests(spec: RandomSpec, num_requests: int, seed: int
                        ) -> list[SampleRequest]:
    """Each prompt's length, then its ids, prompt after prompt; then every output length."""
    assert spec.token_range is not None and spec.token_ids and not spec.prefix_len
    rng = random.Random(seed)
    (ilo, ihi), (olo, ohi), (tlo, thi) = spec.input_range, spec.output_range, spec.token_range
    prompts = [[rng.randint(tlo, thi - 1) for _ in range(rng.randint(ilo, ihi))]
               for _ in range(num_requests)]
    return [SampleRequest(p, len(p), rng.randint(olo, ohi), str(i))
            for i, p in enumerate(prompts)]


def sample_random(spec: RandomSpec, num_requests: int, seed: int, tokenizer: Any = None
                  ) -> list[SampleRequest]:
    if spec.nano_vllm_draws:
        return _nano_vllm_requests(spec, num_requests, seed)
    if not spec.token_ids and tokenizer is None:
        raise ValueError("text prompts need a tokenizer: pass --tokenizer, or "
                         "--token-id-prompts to send token ids")
    rng = np.random.default_rng(seed)
    allowed = _allowed_ids(tokenizer, spec.token_range)
    (ilo, ihi), (olo, ohi) = spec.input_range, spec.output_range
    if ilo > ihi or olo > ohi or olo < 1 or spec.prefix_len + ilo < 1:
        raise ValueError(f"bad length ranges: input {spec.input_range}, "
                         f"output {spec.output_range}, prefix {spec.prefix_len}")
    input_lens = rng.integers(ilo, ihi + 1, size=num_requests)
    output_lens = rng.integers(olo, ohi + 1, size=num_requests)
    prefix = allowed[rng.integers(0, len(allowed), spec.prefix_len)].tolist()
    out = []
    mismatch = 0
    for i in range(num_requests):
        ids = prefix + allowed[rng.integers(0, len(allowed), int(input_lens[i]))].tolist()
        target = len(ids)
        if spec.token_ids:
            prompt: str | list[int] = ids
            n = target
        else:
            prompt, n = _text_of_length(tokenizer, ids, target, allowed, rng)
            mismatch += n - target
        out.append(SampleRequest(prompt, n, int(output_lens[i]), str(i)))
    if mismatch:
        logger.warning("random text prompts: %+d tokens in all against the wanted lengths "
                       "(the tokenizer does not round-trip every id sequence)", mismatch)
    return out


def sample_prefix_repetition(spec: PrefixRepetitionSpec, num_requests: int, seed: int,
                             tokenizer: Any = None, shuffle: bool = True
                             ) -> list[SampleRequest]:
    """`num_prefixes` shared prefixes, each followed by `num_requests // num_prefixes` unique
    suffixes (so num_requests is rounded down to a multiple of num_prefixes)."""
    per_prefix = num_requests // spec.num_prefixes
    if per_prefix == 0:
        raise ValueError(f"--num-prompts ({num_requests}) must be at least "
                         f"--prefix-repetition-num-prefixes ({spec.num_prefixes})")
    if not spec.token_ids and tokenizer is None:
        raise ValueError("text prompts need a tokenizer: pass --tokenizer, or "
                         "--token-id-prompts to send token ids")
    rng = np.random.default_rng(seed)
    allowed = _allowed_ids(tokenizer, None if tokenizer is not None else (0, 10000))

    def piece(n: int) -> list[int]:
        ids = allowed[rng.integers(0, len(allowed), n)].tolist()
        if spec.token_ids or n == 0:
            return ids
        text, _ = _text_of_length(tokenizer, ids, n, allowed, rng)
        return tokenizer.encode(text, add_special_tokens=False)

    out = []
    for _ in range(spec.num_prefixes):
        prefix = piece(spec.prefix_len)
        for _ in range(per_prefix):
            ids = prefix + piece(spec.suffix_len)
            prompt = ids if spec.token_ids else tokenizer.decode(ids)
            out.append(SampleRequest(prompt, len(ids), spec.output_len))
    if shuffle:
        order = rng.permutation(len(out))
        out = [out[j] for j in order]
    for i, r in enumerate(out):
        r.request_id = str(i)
    return out


def _sharegpt_ok(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    """The usual ShareGPT pruning: drop very short, long (> 1024 prompt tokens) or
    oversize (> 2048 in all) conversations."""
    if prompt_len < 4 or prompt_len > 1024 or prompt_len + output_len > 2048:
        return False
    return fixed_output or output_len >= 4


def sample_sharegpt(spec: ShareGPTSpec, num_requests: int, seed: int, tokenizer: Any
                    ) -> list[SampleRequest]:
    """First human turn as the prompt, the reply's length as the output length."""
    if tokenizer is None:
        raise ValueError("the sharegpt dataset needs a tokenizer")
    with open(spec.path, encoding="utf-8") as f:
        data = json.load(f)
    convs = [d["conversations"] for d in data if len(d.get("conversations") or []) >= 2]
    rng = np.random.default_rng(seed)
    if spec.shuffle:
        convs = [convs[j] for j in rng.permutation(len(convs))]
    out: list[SampleRequest] = []
    for conv in convs:
        if len(out) == num_requests:
            break
        prompt, reply = conv[0]["value"], conv[1]["value"]
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        output_len = (spec.output_len if spec.output_len is not None
                      else len(tokenizer.encode(reply, add_special_tokens=False)))
        if not _sharegpt_ok(prompt_len, output_len, spec.output_len is not None):
            continue
        out.append(SampleRequest(prompt, prompt_len, output_len))
    if not out:
        raise ValueError(f"{spec.path}: no usable conversations")
    if len(out) < num_requests and spec.oversample:
        extra = rng.choice(len(out), num_requests - len(out))
        out += [SampleRequest(out[j].prompt, out[j].prompt_len, out[j].expected_output_len)
                for j in extra]
    for i, r in enumerate(out):
        r.request_id = str(i)
    return out


# -------------------------------------------------------------------------------------------
# Flags (vLLM's names and defaults)


def add_dataset_flags(p: argparse.ArgumentParser, with_seed: bool = True) -> None:
    if with_seed:
        p.add_argument("--seed", type=int, default=0, help="seeds the dataset and arrivals")
    p.add_argument("--num-prompts", type=int, default=None, help="number of requests "
                   "(default 1000, or the preset's)")
    p.add_argument("--dataset-name", default="random",
                   choices=[*DATASETS, "prefix-repetition"])
    p.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file")
    p.add_argument("--input-len", type=int, default=None,
                   help="sets --random-input-len")
    p.add_argument("--output-len", type=int, default=None,
                   help="sets the output length of every dataset")
    p.add_argument("--no-oversample", action="store_true",
                   help="do not repeat samples when the dataset has fewer than --num-prompts")
    p.add_argument("--disable-shuffle", action="store_true")
    p.add_argument("--token-id-prompts", action="store_true",
                   help="send random / prefix-repetition prompts as token ids (shoal's; "
                        "vLLM sends text)")
    g = p.add_argument_group("random dataset")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L*(1-r), L*(1+r)]")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="a fixed random prefix shared by every prompt")
    g = p.add_argument_group("sharegpt dataset")
    g.add_argument("--sharegpt-output-len", type=int, default=None)
    g = p.add_argument_group("prefix repetition dataset")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)


def get_samples(ns: argparse.Namespace, tokenizer: Any,
                random_override: RandomSpec | None = None) -> list[SampleRequest]:
    name = ns.dataset_name.replace("-", "_")
    num = ns.num_prompts if ns.num_prompts is not None else 1000
    if name != "sharegpt" and ns.dataset_path is not None:
        raise ValueError(f"--dataset-path is for the sharegpt dataset, not {ns.dataset_name}")
    if name == "random":
        if random_override is not None:
            spec = replace(random_override)
        else:
            spec = RandomSpec.from_ratio(
                ns.input_len if ns.input_len is not None else ns.random_input_len,
                ns.output_len if ns.output_len is not None else ns.random_output_len,
                ns.random_range_ratio, ns.random_prefix_len)
        if ns.token_id_prompts:
            spec.token_ids = True
        if spec.token_ids and spec.token_range is None and tokenizer is None:
            spec.token_range = (0, 10000)
        return sample_random(spec, num, ns.seed, tokenizer)
    if name == "prefix_repetition":
        pspec = PrefixRepetitionSpec(
            ns.prefix_repetition_prefix_len, ns.prefix_repetition_suffix_len,
            ns.prefix_repetition_num_prefixes,
            ns.output_len if ns.output_len is not None else ns.prefix_repetition_output_len,
            token_ids=ns.token_id_prompts)
        return sample_prefix_repetition(pspec, num, ns.seed, tokenizer,
                                        shuffle=not ns.disable_shuffle)
    if ns.dataset_path is None:
        raise ValueError("the sharegpt dataset needs --dataset-path (a local JSON file)")
    sspec = ShareGPTSpec(ns.dataset_path,
                         ns.output_len if ns.output_len is not None else ns.sharegpt_output_len,
                         oversample=not ns.no_oversample, shuffle=not ns.disable_shuffle)
    return sample_sharegpt(sspec, num, ns.seed, tokenizer)
