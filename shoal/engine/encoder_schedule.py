"""The scheduler's side of images: which encoder outputs the runner computes each step, and
the books of its encoder cache (the runner keeps exactly the entries named here).

A chunk of a prompt that reaches into an image's span needs that image's encoder output. It
is either in the cache (encoded for an earlier chunk, or for another request with the same
image: entries are keyed by content hash), or encoded in this step, within a per-step budget
of encoder outputs and the cache's capacity. When neither allows, the chunk stops before
the image and the image waits for a later step. An entry is referenced by the requests that
still have positions of its span to compute; unreferenced entries stay (a repeated image is
not encoded again) until their room is needed, least recently used first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from shoal.core.request import Request


@dataclass
class EncoderPlan:
    """What scheduling n tokens of a request needs: (feature index, identifier, embeds) to
    encode, and the identifiers it will read."""

    encode: list[tuple[int, str, int]] = field(default_factory=list)
    reads: list[str] = field(default_factory=list)


class EncoderSchedule:
    def __init__(self, cache_size: int, step_budget: int, whole_spans: bool = False):
        """cache_size: encoder outputs (tokens) the runner's cache holds; step_budget:
        encoder outputs one step may compute. An image larger than either is refused by the
        frontend (EngineLimits.mm_max_embeds). whole_spans: an image's positions are only
        scheduled all in one step (models whose image tokens attend to each other both
        ways: Gemma 3)."""
        self.cache_size, self.step_budget = cache_size, step_budget
        self.whole_spans = whole_spans
        self.entries: OrderedDict[str, int] = OrderedDict()  # identifier -> embeds, LRU first
        self.refs: dict[str, set[int]] = {}  # identifier -> serials of its readers
        self.used = 0
        self._step_left = step_budget
        self._free: list[str] = []
        self._encode: list[tuple[int, int]] = []
        self._costs: dict[str, int] = {}  # planned encodes' computed tokens, until committed
        # cumulative since start-up: images encoded, images found in the cache
        self.num_encoded = 0
        self.num_hits = 0

    def begin_step(self) -> None:
        self._step_left = self.step_budget
        self._costs.clear()

    def fit(self, req: Request, start: int, n: int) -> tuple[int, EncoderPlan]:
        """How many of the n tokens from `start` can run this step, and what they need."""
        plan = EncoderPlan()
        if not req.mm_features:
            return n, plan
        left, room = self._step_left, self._evictable_room()
        pinned: set[str] = set()  # unreferenced entries this plan reads: not room after all
        for i, f in enumerate(req.mm_features):
            if f.offset >= start + n:
                break
            if f.end <= start:
                continue
            if self.whole_spans and f.end > start + n:
                return max(f.offset - start, 0), plan  # the whole span in a later step
            if f.identifier in self.entries or any(e[1] == f.identifier for e in plan.encode):
                if (f.identifier in self.entries and f.identifier not in self.refs
                        and f.identifier not in pinned):
                    pinned.add(f.identifier)
                    room -= self.entries[f.identifier]
                plan.reads.append(f.identifier)
                continue
            need, cost = f.num_embeds, f.encoder_cost  # (kept, computed: EVS keeps fewer)
            # an item costing more than a whole step's budget (a pruned video's tower runs
            # every frame) runs alone in a step, or it would never run
            first_of_step = self._step_left == self.step_budget and not plan.encode
            over = cost > left and not first_of_step
            if over or need > room:
                return max(f.offset - start, 0), plan  # stop before the image
            left -= cost
            room -= need
            plan.encode.append((i, f.identifier, need))
            self._costs[f.identifier] = cost
            plan.reads.append(f.identifier)
        return n, plan

    def commit(self, req: Request, plan: EncoderPlan) -> None:
        """The request was scheduled with the plan's tokens. Its cached reads are referenced
        first, so that making room for its encodes never evicts them."""
        encoded = {ident for _, ident, _ in plan.encode}
        for ident in plan.reads:
            if ident in encoded:
                continue
            if req.serial not in self.refs.get(ident, ()):
                self.num_hits += 1
            self.entries.move_to_end(ident)
            self.refs.setdefault(ident, set()).add(req.serial)
        for _, ident, need in plan.encode:
            self._make_room(need)
            self.entries[ident] = need
            self.used += need
            self._step_left -= self._costs.pop(ident, need)
            self.num_encoded += 1
            self.refs.setdefault(ident, set()).add(req.serial)
        self._encode.extend((req.serial, i) for i, _, _ in plan.encode)

    def span_start(self, req: Request, position: int) -> int:
        """whole_spans: where a prefix hit of `position` tokens must end instead, so that no
        image is cut (the start of the image it ends inside, else itself)."""
        for f in req.mm_features or ():
            if f.offset < position < f.end:
                return f.offset
        return position

    def release_done(self, req: Request) -> None:
        """Drops the request's references to images whose spans it has computed (an image
        it shows again later in the prompt stays referenced)."""
        done = req.num_computed_tokens
        needed = {f.identifier for f in req.mm_features or () if f.end > done}
        for f in req.mm_features or ():
            if f.end <= done and f.identifier not in needed:
                self._unref(f.identifier, req.serial)

    def release(self, req: Request) -> None:
        """The request ended or was preempted: none of its images is read for it now."""
        for f in req.mm_features or ():
            self._unref(f.identifier, req.serial)

    def take(self) -> tuple[list[str], list[tuple[int, int]]]:
        """This step's (entries to drop, (serial, feature index) to encode)."""
        free, encode = self._free, self._encode
        self._free, self._encode = [], []
        return free, encode

    def reset(self) -> None:
        """Every entry forgotten (the runner dropped its cache: a fault, a weight update)."""
        self._free.extend(self.entries)
        self._encode.clear()
        self.entries.clear()
        self.refs.clear()
        self.used = 0

    def _unref(self, ident: str, serial: int) -> None:
        readers = self.refs.get(ident)
        if readers is not None:
            readers.discard(serial)
            if not readers:
                del self.refs[ident]

    def _evictable_room(self) -> int:
        return self.cache_size - self.used + sum(
            n for ident, n in self.entries.items() if ident not in self.refs)

    def _make_room(self, need: int) -> None:
        for ident in [i for i in self.entries if i not in self.refs]:
            if self.cache_size - self.used >= need:
                return
            self.used -= self.entries.pop(ident)
            self._free.append(ident)


# The fewest encoder outputs the cache holds (and a step may compute), whatever the token
# budget: one 1024x768 image is about 1,000 outputs for Qwen2.5-VL, and a CPU engine's token
# budget may be 256.
MIN_ENCODER_CACHE = 16384


# Models whose image tokens attend to each other both ways within one image (transformers'
# token_type_ids mask): an image is never split over steps or prefix-cache hits.
WHOLE_SPAN_ARCHITECTURES = frozenset({"Gemma3ForConditionalGeneration"})


def whole_spans(hf_config: Any) -> bool:
    return any(a in WHOLE_SPAN_ARCHITECTURES for a in getattr(hf_config, "architectures", None)
               or [])


def encoder_cache_size(config: Any, hf_config: Any) -> int:
    """Encoder outputs the runner keeps for a vision-language model (0 for any other): also
    the largest image a request may carry (EngineLimits.mm_max_embeds)."""
    if (getattr(hf_config, "multimodal_config", None) is None
            or config.model_config.runner == "pooling"):  # the pooling runner places none
        return 0
    return max(config.scheduler_config.max_num_batched_tokens, MIN_ENCODER_CACHE)
