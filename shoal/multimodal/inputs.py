"""What a multimodal item carries from the frontend to the engine core and the model runner:
plain data (msgspec structs, numpy bytes), no torch, so it crosses processes as msgpack.

A prompt's image becomes one MultiModalFeature: the processor's tensors for it (pixel values,
grid sizes), its place in the expanded prompt, and a content hash that names its encoder
output in the encoder cache and enters the prefix-cache hashes of the blocks it spans."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import msgspec
import numpy as np


class TensorData(msgspec.Struct, array_like=True, frozen=True):
    """One array as bytes (C order, little-endian as numpy writes it on x86 and ARM)."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, array: np.ndarray) -> TensorData:
        a = np.ascontiguousarray(array)
        return cls(a.dtype.str, list(a.shape), a.tobytes())

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)


class MultiModalFeature(msgspec.Struct, array_like=True, frozen=True):
    """One image (or video) of a prompt.

    offset, length: the span of prompt positions it owns, from its first to its last
    placeholder token. embed_mask (one byte per span position, 1 = an encoder output goes
    there) is set when the span mixes placeholders with text tokens the processor added
    (Idefics3's tile markers); None: every position of the span takes an encoder output."""

    modality: str  # "image"
    identifier: str  # content hash: the encoder cache's key
    offset: int
    length: int
    data: dict[str, TensorData]
    embed_mask: bytes | None = None
    # the tokens the encoder computes, when more than it keeps (EVS: a pruned video's tower
    # runs over every frame); None: num_embeds
    encoder_tokens: int | None = None

    @property
    def num_embeds(self) -> int:
        """Encoder outputs it keeps (what it costs the encoder cache)."""
        if self.embed_mask is None:
            return self.length
        return sum(self.embed_mask)

    @property
    def encoder_cost(self) -> int:
        """Encoder tokens it computes (what it costs a step's encoder budget)."""
        return self.num_embeds if self.encoder_tokens is None else self.encoder_tokens

    @property
    def end(self) -> int:
        return self.offset + self.length

    def embeds_before(self, position: int) -> int:
        """Encoder outputs placed at span positions before `position` (a prompt position)."""
        k = min(max(position - self.offset, 0), self.length)
        if self.embed_mask is None:
            return k
        return sum(self.embed_mask[:k])

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: v.array() for k, v in self.data.items()}


def content_hash(kind: str, arrays: Mapping[str, np.ndarray]) -> str:
    """A hash of an item's processed tensors (and the model family that made them): two
    prompts share an encoder output, and prefix-cache blocks, only when these are equal."""
    h = hashlib.blake2b(digest_size=16)
    h.update(kind.encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"\x00{name}\x00{a.dtype.str}\x00{a.shape}\x00".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def make_feature(kind: str, modality: str, offset: int, length: int,
                 arrays: Mapping[str, np.ndarray], embed_mask: bytes | None = None,
                 encoder_tokens: int | None = None) -> MultiModalFeature:
    """A feature whose identifier is the content hash of its arrays."""
    return MultiModalFeature(modality, content_hash(kind, arrays), offset, length,
                             {k: TensorData.of(v) for k, v in arrays.items()}, embed_mask,
                             encoder_tokens)


def check_features(features: list[MultiModalFeature], prompt_len: int, max_embeds: int,
                   max_span: int = 0) -> None:
    """What the engine core checks of a request's images (whoever built them): the model
    takes images, their spans are in the prompt, in order, apart, and each fits the encoder
    cache (and max_span, when set: a model that runs each image within one step)."""
    if not max_embeds:
        raise ValueError("this model does not take images (mm_features)")
    end = 0
    for i, f in enumerate(features):
        if f.offset < end or f.length <= 0 or f.end > prompt_len:
            raise ValueError(f"mm_features[{i}]: span [{f.offset}, {f.end}) is not inside the "
                             f"prompt ({prompt_len} tokens) after the image before it")
        if f.embed_mask is not None and len(f.embed_mask) != f.length:
            raise ValueError(f"mm_features[{i}]: embed_mask has {len(f.embed_mask)} entries "
                             f"for a span of {f.length}")
        if not 0 < f.num_embeds <= max_embeds:
            raise ValueError(f"mm_features[{i}]: {f.num_embeds} encoder tokens; an image may "
                             f"have 1 to {max_embeds} (the encoder cache)")
        if max_span and f.length > max_span:
            raise ValueError(f"mm_features[{i}]: an image of {f.length} tokens must run in one "
                             f"step, but max_num_batched_tokens is {max_span}")
        end = f.end
