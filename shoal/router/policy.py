"""The routing decision: the backend holding the longest prefix of the prompt's blocks,
unless it is much busier than the least loaded one; otherwise the least loaded (round robin
among equals).

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
class Backend:
    url: str
    kv_events: list[str] = field(default_factory=list)  # PUB endpoints (one per DP rank)
    replay: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    routed: int = 0  # requests sent here
    prefix_routed: int = 0  # ...of which for a prefix it held


class Router:
    def __init__(self, backends: Sequence[Backend], block_size: int = 16,
                 max_imbalance: int = 8):
        if not backends:
            raise ValueError("the router needs at least one --backend")
        self.backends = list(backends)
        self.block_size = block_size
        self.max_imbalance = max_imbalance
        self.index = PrefixIndex()
        self._next = 0  # round robin among equally loaded backends

    def choose(self, hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """(backend id, blocks of its prefix hit) for a prompt's full-block hashes."""
        matched = self.index.match(hashes) if hashes else {}
        least = min(b.in_flight for b in self.backends)
        if matched:
            best = max(matched, key=lambda i: (matched[i], -self.backends[i].in_flight))
            if self.backends[best].in_flight <= least + self.max_imbalance:
                return best, matched[best]
        n = len(self.backends)
        for k in range(n):
            i = (self._next + k) % n
            if self.backends[i].in_flight == least:
                self._next = i + 1
                return i, matched.get(i, 0)
        raise AssertionError("unreachable: some backend has the least load")

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
        return {"block_size": self.block_size, "backends": [
            {"url": b.url, "in_flight": b.in_flight, "routed": b.routed,
             "prefix_routed": b.prefix_routed, "cached_blocks": self.index.num_blocks(i)}
            for i, b in enumerate(self.backends)]}
