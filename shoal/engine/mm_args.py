"""The engine arguments of image and video input (vLLM's names), kept beside EngineArgs, which
inherits them: what a prompt may carry and where the server may read images from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_IMAGES_PER_PROMPT = 4
DEFAULT_VIDEOS_PER_PROMPT = 1
_MODALITIES = {"image": DEFAULT_IMAGES_PER_PROMPT, "video": DEFAULT_VIDEOS_PER_PROMPT}


def _arg(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class MultiModalArgs:
    limit_mm_per_prompt: dict[str, Any] | None = _arg(
        None, 'items one prompt may carry by modality, as JSON: {"image": 2, "video": 1} '
              f'(default: {DEFAULT_IMAGES_PER_PROMPT} images, {DEFAULT_VIDEOS_PER_PROMPT} '
              'video; {"image": 0} serves text alone)')
    allowed_media_domains: list[str] | None = _arg(
        None, "hosts whose http(s) image URLs the server fetches (default: none)")
    allowed_local_media_path: str | None = _arg(
        None, "a folder whose files file:// image URLs may read (default: none)")
    media_io_threads: int | None = _arg(
        None, "threads that fetch, decode and process a request's images and videos off the "
              "server's event loop (default: $SHOAL_MEDIA_THREADS, else 4 or the cores if "
              "fewer)")
    video_pruning_rate: float = _arg(
        0.0, "EVS: the share of a video's tokens dropped after the vision tower, the ones "
             "most like the same place in the frame before (0 <= rate < 1; 0: none)")

    def images_per_prompt(self) -> int:
        """The image limit of one prompt; ValueError naming the field when it (or another
        multimodal argument: EngineArgs checks them all through this) is bad."""
        rate = self.video_pruning_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
            raise ValueError(f"video_pruning_rate must be a number in [0, 1) (got {rate!r})")
        threads = self.media_io_threads
        if threads is not None and (type(threads) is not int or threads < 1):
            raise ValueError(f"media_io_threads must be an integer >= 1 (got {threads!r})")
        self.videos_per_prompt()
        return self._limit("image")

    def language_model_only(self) -> bool:
        """Every modality's limit 0 (vLLM's language-model-only mode): a checkpoint whose text
        model runs alone (Qwen3.5's) loads without its vision tower (loader/text_only.py)."""
        return self.images_per_prompt() == 0 and self.videos_per_prompt() == 0

    def videos_per_prompt(self) -> int:
        return self._limit("video")

    def _limit(self, modality: str) -> int:
        limits = dict(self.limit_mm_per_prompt or {})
        unknown = sorted(set(limits) - set(_MODALITIES))
        if unknown:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {unknown[0]!r}; this "
                             "build takes 'image' and 'video'")
        default = _MODALITIES[modality]
        n = limits.get(modality, default)
        if isinstance(n, dict):  # vLLM's {"image": {"count": 2, ...}} form
            n = n.get("count", default)
        if type(n) is not int or n < 0:
            raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be an integer >= 0 "
                             f"(got {n!r})")
        return n
