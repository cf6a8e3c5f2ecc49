"""Training data for an EAGLE-3 head (benchmarks/eagle3_train_head.py): the target's own
greedy continuations of prompts, and for every position of each sequence the residual stream
entering the head's three aux layers and the target's greedy next token.

The states come from the engine's own target module, run once over whole sequences with
`record_aux` switched on for that pass (the recorder the engine uses at serve time) and
attention over packed sequences without a KV cache (PackedSeqs: what pooling steps use);
serve_time_aux_error() compares them with what a speculating engine's target recorded in a
real prefill step, so the head is trained on the states it is served."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import engine_internals
import torch

from shoal import SamplingParams
from shoal.attention.packed import PackedSeqs
from shoal.attention.torch_backend import TorchAttentionBackend

# Chat prompts: every task with every topic. Held-out prompts take topics no training prompt
# has (held_out_topics), so acceptance is measured on text the head never saw.
TASKS = [
    "Explain {t} to a curious twelve-year-old in a few paragraphs.",
    "Write a short story in which {t} plays a central role.",
    "List five surprising facts about {t}, one sentence each.",
    "Write a persuasive paragraph arguing that everyone should learn about {t}.",
    "Describe the history of {t} in about two hundred words.",
    "Write a Python function related to {t}, with a docstring and an example call.",
    "What are the most common misconceptions about {t}? Answer as a numbered list.",
    "Write a friendly email inviting a colleague to a workshop on {t}.",
]
TOPICS = [
    "volcanoes", "the French Revolution", "photosynthesis", "black holes", "honey bees",
    "the stock market", "origami", "the immune system", "electric cars", "jazz music",
    "the Roman Empire", "machine learning", "coral reefs", "chess openings", "coffee brewing",
    "the water cycle", "ancient Egypt", "solar panels", "sleep", "the printing press",
    "climate change", "sourdough bread", "the Moon landing", "earthquakes", "vaccines",
    "the Great Wall of China", "recycling plastic", "rainforests", "the Olympic Games",
    "compound interest", "DNA", "hurricanes", "the Internet", "penguins", "glaciers",
    "public libraries", "marathon training", "the Renaissance", "bicycle repair", "tea",
]
HELD_OUT_TOPICS = ["lighthouses", "octopuses", "the Silk Road", "mountain climbing",
                   "paper money", "thunderstorms", "board games", "submarines"]


def chat_prompts(n: int, held_out: bool = False, seed: int = 0) -> list[str]:
    """n prompts: of TOPICS (training; shuffled, the first n) or of HELD_OUT_TOPICS."""
    topics = HELD_OUT_TOPICS if held_out else TOPICS
    every = [task.format(t=t) for t in topics for task in TASKS]
    random.Random(seed + held_out).shuffle(every)
    if not 1 <= n <= len(every):
        raise ValueError(f"prompts: {n} {'held-out' if held_out else 'training'} prompts "
                         f"asked, the built-in list has 1..{len(every)}")
    return every[:n]


def file_prompts(path: Path, n_train: int, n_held: int) -> tuple[list[str], list[str]]:
    """A text file, one prompt a line: the first n_train for training, the next n_held held
    out."""
    lines = [s.strip() for s in path.read_text().splitlines() if s.strip()]
    if len(lines) < n_train + n_held:
        raise ValueError(f"prompt file {path}: {len(lines)} prompts, {n_train} training + "
                         f"{n_held} held-out needed")
    return lines[:n_train], lines[n_train:n_train + n_held]


def chat_token_prompts(llm: Any, texts: list[str]) -> list[dict]:
    """Each text as one user turn through the model's chat template."""
    inputs = llm.llm_engine.inputs
    return [{"prompt_token_ids": inputs.process_chat(
        [{"role": "user", "content": text}]).prompt_token_ids} for text in texts]


def random_token_prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    """Random ids in [100, vocab): a random-weight target has no tokenizer worth using."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(length)]}
            for _ in range(n)]


def greedy_sequences(llm: Any, prompts: list[dict], max_tokens: int,
                     ignore_eos: bool) -> list[list[int]]:
    """prompt + the target's greedy continuation, per prompt (shoal's offline API)."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [list(p["prompt_token_ids"]) + list(o.outputs[0].token_ids)
            for p, o in zip(prompts, outs)]


@dataclass
class HeadData:
    """One entry per sequence: ids [L] (long), aux [L, 3 * H] (the target's dtype, on its
    device: the residual stream entering each aux layer at each position, concatenated as
    the head's fc reads it) and greedy [L] (the target's argmax after ids[:p + 1]). Every
    position is trained on, the prompt's too: measured on SmolLM2, leaving the prompt rows
    out of the loss (no draft is made from them) did not raise held-out acceptance."""

    ids: list[torch.Tensor]
    aux: list[torch.Tensor]
    greedy: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.ids)


@contextmanager
def _packed_pass(target: Any, layer_ids: tuple[int, ...], num_tokens: int) -> Iterator[None]:
    """The target's aux recorder on (record_aux) and the torch attention backend bound (a
    backend that fuses rotary into its cache write has no cache-less path), for one
    cache-less forward; both undone after."""
    layers = target.attention_layers()
    backends = [a.backend for a in layers]
    model = target.model
    had = {k: model.__dict__[k] for k in ("aux_layers", "aux_route", "aux_buffer")
           if k in model.__dict__}
    try:
        for a in layers:
            a.backend = TorchAttentionBackend()
        model.record_aux(layer_ids, num_tokens)
        yield
    finally:
        for a, b in zip(layers, backends):
            a.backend = b
        for k in ("aux_layers", "aux_route", "aux_buffer"):
            model.__dict__.pop(k, None)
        model.__dict__.update(had)


@torch.inference_mode()
def record_states(target: Any, seqs: list[list[int]], layer_ids: tuple[int, ...],
                  tokens_per_pass: int = 4096, logits_rows: int = 2048) -> HeadData:
    """Runs `target` (the engine's model module) over whole sequences, several packed in a
    pass, keeping the aux states the head reads and the greedy next token everywhere."""
    device = next(target.parameters()).device
    data = HeadData([], [], [])
    start = 0
    while start < len(seqs):
        group = [seqs[start]]
        while (start + len(group) < len(seqs)
               and sum(map(len, group)) + len(seqs[start + len(group)]) <= tokens_per_pass):
            group.append(seqs[start + len(group)])
        start += len(group)
        lens = [len(s) for s in group]
        ids = torch.tensor([t for s in group for t in s], device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lens])
        with _packed_pass(target, layer_ids, len(ids)):
            hidden = target.model(ids, positions, PackedSeqs.build(lens, True, device))
            aux = target.model.aux_buffer[:len(ids)].clone()
        greedy = torch.cat([target.compute_logits(hidden[i:i + logits_rows]).argmax(-1)
                            for i in range(0, len(ids), logits_rows)])
        for part in (ids, aux, greedy):
            assert part.shape[0] == sum(lens)
        data.ids += list(ids.cpu().split(lens))
        data.aux += list(aux.split(lens))
        data.greedy += list(greedy.cpu().split(lens))
    return data


def draft_vocabulary(data: HeadData, size: int, vocab: int) -> torch.Tensor:
    """The draft vocabulary: the `size` target ids most frequent among the greedy next
    tokens (the head's labels), then the input tokens, then the lowest unused ids; sorted."""
    if not 1 <= size <= vocab:
        raise ValueError(f"draft_vocab: {size} must be in [1, vocab_size={vocab}]")
    counts: Counter[int] = Counter()
    for g in data.greedy:
        counts.update(g.tolist())
    inputs: Counter[int] = Counter()
    for ids in data.ids:
        inputs.update(ids.tolist())
    chosen = [t for t, _ in counts.most_common(size)]
    seen = set(chosen)
    chosen += [t for t, _ in inputs.most_common() if t not in seen][:size - len(chosen)]
    seen = set(chosen)
    rest = (t for t in range(vocab) if t not in seen)
    while len(chosen) < size:
        chosen.append(next(rest))
    return torch.tensor(sorted(chosen), dtype=torch.long)


def label_coverage(data: HeadData, draft_ids: torch.Tensor) -> float:
    """The share of greedy next tokens inside the draft vocabulary."""
    labels = torch.cat(data.greedy)
    return float(torch.isin(labels, draft_ids).float().mean())


@torch.inference_mode()
def serve_time_aux_error(spec_llm: Any, plain_target: Any, prompt_ids: list[int],
                         layer_ids: tuple[int, ...], skip_rows: int) -> float:
    """Relative error (Frobenius norms) between the aux states a speculating engine's target records while
    serving `prompt_ids` (one prefill step: a prompt it has not seen, shorter than the step's
    token budget, max_tokens 1) and record_states' on the plain engine's target. The first
    skip_rows rows are left out: under async scheduling a decode or verify step (k + 1 rows
    at most) may be launched after the prefill and write over them."""
    if len(prompt_ids) <= skip_rows:
        raise ValueError(f"serve-time check: a prompt of more than {skip_rows} tokens needed")
    spec_llm.generate({"prompt_token_ids": prompt_ids},
                      SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    buffer = engine_internals.runner(spec_llm).model.model.aux_buffer
    served = buffer[skip_rows:len(prompt_ids)].float()
    ours = record_states(plain_target, [prompt_ids], layer_ids).aux[0][skip_rows:].float()
    return float((served - ours).norm() / ours.norm().clamp_min(1e-30))
