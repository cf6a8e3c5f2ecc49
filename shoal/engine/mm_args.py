"""The engine arguments of image input (vLLM's names), kept beside EngineArgs, which
inherits them: what a prompt may carry and where the server may read images from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_IMAGES_PER_PROMPT = 4


def _arg(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class MultiModalArgs:
    limit_mm_per_prompt: dict[str, Any] | None = _arg(
        None, 'items one prompt may carry by modality, as JSON: {"image": 2} (default: '
              f'{DEFAULT_IMAGES_PER_PROMPT} images; {{"image": 0}} serves text alone)')
    allowed_media_domains: list[str] | None = _arg(
        None, "hosts whose http(s) image URLs the server fetches (default: none)")
    allowed_local_media_path: str | None = _arg(
        None, "a folder whose files file:// image URLs may read (default: none)")

    def images_per_prompt(self) -> int:
        """The image limit of one prompt; ValueError naming the field when it is bad."""
        limits = dict(self.limit_mm_per_prompt or {})
        unknown = sorted(set(limits) - {"image"})
        if unknown:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {unknown[0]!r}; this "
                             "build takes 'image'")
        n = limits.get("image", DEFAULT_IMAGES_PER_PROMPT)
        if isinstance(n, dict):  # vLLM's {"image": {"count": 2, ...}} form
            n = n.get("count", DEFAULT_IMAGES_PER_PROMPT)
        if type(n) is not int or n < 0:
            raise ValueError(f"limit_mm_per_prompt['image'] must be an integer >= 0 (got "
                             f"{n!r})")
        return n
