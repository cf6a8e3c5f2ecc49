"""The routing decision: the engine holding the longest prefix of the prompt's blocks,
unless it is much busier than the least loaded one; otherwise the least loaded (round robin
among equals).

An engine is a backend's replica: a data-parallel server (data_parallel_size > 1, its
replicas behind one URL) is one replica per DP rank, each publishing its own KV events on
its own endpoint, and a request for one of them names it in vLLM's X-data-parallel-rank
header. Prefix hits and loads are counted per replica; a backend with one events endpoint
(or none) is one replica the router does not name (its server places the request).

The prompt's block hashes are the engines' own (kv_cache/hashing.py), so they match the
hashes of the engines' KV events: the expanded token ids, and for a block over an image's
(or video's) span the engine's content hash of that item, so two prompts that differ only in
an image share their blocks before it and none after. A chat's images are rendered by a
backend's /tokenize, which processes them as the chat route will and names each item's
span and content hash (mm_placeholders)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.kv_cache.hashing import BlockHash, hash_full_blocks
from shoal.router import upstream
from shoal.router.index import PrefixIndex

logger = logging.getLogger(__name__)

# What a chat request passes to /tokenize to render its prompt as the backend will.
_CHAT_TOKENIZE_FIELDS = ("messages", "add_generation_prompt", "continue_final_message",
                         "chat_template", "chat_template_kwargs", "tools", "documents",
                         "add_special_tokens")


@dataclass(frozen=True)
class ImageSpan:
    """An image's (or video's) span of the expanded prompt and the engine's content hash of
    it (the attributes hash_full_blocks reads of a MultiModalFeature)."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class RoutedPrompt:
    """What a prompt's block hashes are made of."""

    token_ids: list[int]
    images: list[ImageSpan] = field(default_factory=list)


def parse_placeholders(value: Any) -> list[ImageSpan] | None:
    """/tokenize's mm_placeholders as spans; None when malformed (the prompt then routes by
    load alone: a wrong image identity must not route by a text match)."""
    if value is None:
        return []
    if not isinstance(value, list):
        return None
    spans = []
    for item in value:
        if not isinstance(item, dict):
            return None
        ident, offset, length = (item.get(k) for k in ("identifier", "offset", "length"))
        if (not isinstance(ident, str) or type(offset) is not int or type(length) is not int
                or offset < 0 or length <= 0):
            return None
        spans.append(ImageSpan(ident, offset, length))
    return spans


@dataclass
class Replica:
    """One engine of a backend: rank is its DP rank (named to the backend), None for a
    backend's only engine."""

    rank: int | None
    in_flight: int = 0
    routed: int = 0  # requests sent here
    prefix_routed: int = 0  # ...of which for a prefix it held


@dataclass
class Backend:
    url: str
    # KV events PUB endpoints: one per DP rank, in rank order (the replicas bind the port
    # plus their rank), or one for a server of one engine
    kv_events: list[str] = field(default_factory=list)
    replay: list[str | None] = field(default_factory=list)
    replicas: list[Replica] = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.kv_events)
        self.replicas = [Replica(r) for r in range(n)] if n > 1 else [Replica(None)]

    @property
    def in_flight(self) -> int:
        return sum(r.in_flight for r in self.replicas)


@dataclass(frozen=True)
class Target:
    """Where a request goes: replica `replica` of backend `backend` (indices into
    Router.backends and its replicas), and how many leading blocks of the prompt it holds."""

    backend: int
    replica: int = 0
    hit: int = 0

    @property
    def holder(self) -> tuple[int, int]:
        """Its key in the prefix index."""
        return self.backend, self.replica


class Router:
    def __init__(self, backends: Sequence[Backend], block_size: int = 16,
                 max_imbalance: int = 8):
        if not backends:
            raise ValueError("the router needs at least one --backend")
        self.backends = list(backends)
        self.block_size = block_size
        self.max_imbalance = max_imbalance
        self.index = PrefixIndex()  # keyed by (backend id, replica index): Target.holder
        self._holders = [(b, j) for b, backend in enumerate(self.backends)
                         for j in range(len(backend.replicas))]
        self._next = 0  # round robin among equally loaded replicas

    def replica(self, holder: tuple[int, int]) -> Replica:
        b, j = holder
        return self.backends[b].replicas[j]

    def choose(self, hashes: Sequence[BlockHash]) -> Target:
        """The replica for a prompt's full-block hashes."""
        matched = self.index.match(hashes) if hashes else {}
        load = {h: self.replica(h).in_flight for h in self._holders}
        least = min(load.values())
        if matched:
            best = max(matched, key=lambda h: (matched[h], -load[h]))
            if load[best] <= least + self.max_imbalance:
                return Target(*best, hit=matched[best])
        n = len(self._holders)
        for k in range(n):
            h = self._holders[(self._next + k) % n]
            if load[h] == least:
                self._next = (self._next + k + 1) % n
                return Target(*h, hit=matched.get(h, 0))
        raise AssertionError("unreachable: some replica has the least load")

    def hashes(self, prompt: RoutedPrompt, salt: str | None) -> list[BlockHash]:
        return hash_full_blocks(list(prompt.token_ids), self.block_size, [], salt,
                                prompt.images)

    async def prompt(self, path: str, body: dict[str, Any], headers: dict[str, str]
                     ) -> RoutedPrompt | None:
        """The prompt as the backend will see it: token ids given, or from the least loaded
        backend's /tokenize with a chat's images (None when it cannot be known: a batch of
        prompts, a backend without /tokenize...)."""
        if path.endswith("/chat/completions"):
            query = {k: body[k] for k in _CHAT_TOKENIZE_FIELDS if k in body}
            if "messages" not in query:
                return None
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, list) and all(type(t) is int for t in prompt):
                return RoutedPrompt(prompt)
            if not isinstance(prompt, str):
                return None
            query = {"prompt": prompt}
            if "add_special_tokens" in body:
                query["add_special_tokens"] = body["add_special_tokens"]
        target = min(self.backends, key=lambda b: b.in_flight)
        try:
            resp = await upstream.request(target.url, "POST", "/tokenize",
                                          json.dumps(query).encode(), headers)
            data = json.loads(await resp.read_all())
        except (upstream.UpstreamError, ValueError, OSError) as e:
            logger.warning("tokenizing on %s failed: %r", target.url, e)
            return None
        if (resp.status != 200 or not isinstance(data, dict)
                or not isinstance(data.get("tokens"), list)):
            return None
        images = parse_placeholders(data.get("mm_placeholders"))
        if images is None:
            logger.warning("tokenizing on %s: malformed mm_placeholders", target.url)
            return None
        return RoutedPrompt(data["tokens"], images)

    def state(self) -> dict[str, Any]:
        """Each backend's totals and its replicas' own counts."""
        backends = []
        for i, b in enumerate(self.backends):
            replicas = [{"rank": r.rank, "in_flight": r.in_flight, "routed": r.routed,
                         "prefix_routed": r.prefix_routed,
                         "cached_blocks": self.index.num_blocks((i, j))}
                        for j, r in enumerate(b.replicas)]
            totals = {k: sum(r[k] for r in replicas)
                      for k in ("in_flight", "routed", "prefix_routed", "cached_blocks")}
            backends.append({"url": b.url, **totals, "replicas": replicas})
        return {"block_size": self.block_size, "backends": backends}
