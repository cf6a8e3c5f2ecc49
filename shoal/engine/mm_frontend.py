"""The frontend's side of images and videos: checks what a prompt carries (count, kind,
size), runs the model's processor (placeholders expanded, tensors made) and sizes each item
against the engine's encoder cache. Runs where the tokenizer runs, never in the engine core.

Fetching, decoding and processing media take long (an image: tens of ms, a video: seconds),
so the server runs them on a bounded pool of threads (`offload`), never on its event loop,
where they would stall every other request's stream. PIL and PyAV are imported on first use,
so no shoal module loads them for a text model (transformers 5.25's own `import transformers`
still probes PIL where it is installed)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from shoal import envs
from shoal.engine.cpu_quota import usable_cores
from shoal.multimodal.chat_parts import Placeholders, VideoSource
from shoal.multimodal.inputs import MultiModalFeature
from shoal.multimodal.media import MediaSettings, check_image, load_image
from shoal.multimodal.processors import processor_class
from shoal.multimodal.video import Video, load_video, to_video

T = TypeVar("T")

MEDIA_THREADS_ENV = envs.SHOAL_MEDIA_THREADS.name


def default_media_threads() -> int:
    """$SHOAL_MEDIA_THREADS, else 4 (at most the usable cores): enough to overlap fetches and
    decodes, few enough that media work cannot starve the frontend's own thread."""
    value = envs.SHOAL_MEDIA_THREADS.get()
    if value is not None:
        return value
    return min(4, usable_cores())


class MultiModalFrontend:
    def __init__(self, processor: Any, max_embeds: int, max_images: int,
                 media: MediaSettings, max_videos: int = 0, threads: int | None = None):
        self.processor = processor
        self.max_embeds = max_embeds  # the engine's encoder cache: the largest image
        self.max_images = max_images
        self.max_videos = max_videos
        self.media = media
        self.threads = threads or default_media_threads()
        self._pool: ThreadPoolExecutor | None = None

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the media threads (started on first use), awaited without blocking
        the event loop; its exception (a ValueError for bad media) is raised here."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor(), functools.partial(fn, *args))

    def map(self, fn: Callable[[Any], T], items: list[Any]) -> list[T]:
        """[fn(item) for item in items] on the media threads, in order (offline batches:
        an image's preprocessing takes tens of milliseconds, mostly outside the GIL); the
        first exception is raised."""
        if len(items) < 2:
            return [fn(item) for item in items]
        return list(self._executor().map(fn, items))

    def _executor(self) -> ThreadPoolExecutor:
        """The media threads, started on first use."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shoal-media")
        return self._pool

    @property
    def image_placeholder(self) -> str:
        """The image placeholder, carrying the video one for chat video parts."""
        return Placeholders(self.processor.image_placeholder, self.video_placeholder)

    @property
    def video_placeholder(self) -> str | None:
        return getattr(self.processor, "video_placeholder", None)

    @classmethod
    def build(cls, model: str | None, tokenizer: Any, max_embeds: int, args: Any
              ) -> MultiModalFrontend | None:
        """The frontend of an engine that reads images (max_embeds > 0), from the model's
        folder; None for a text model."""
        if not max_embeds or model is None:
            return None
        from shoal.loader.resolve import resolve_model
        from shoal.loader.safetensors_loader import load_folder_config

        source = resolve_model(model)
        config = load_folder_config(source.path)
        arch = next(a for a in config.architectures if processor_class(a) is not None)
        processor = processor_class(arch)(source.path, config, tokenizer)
        rate = float(getattr(args, "video_pruning_rate", 0.0) or 0.0)
        if rate and getattr(processor, "video_placeholder", None) and not getattr(
                processor, "supports_evs", False):
            raise ValueError(f"video_pruning_rate (EVS) is not supported for {arch}'s videos; "
                             "leave it at 0")
        processor.video_pruning_rate = rate
        media = MediaSettings(allowed_domains=tuple(args.allowed_media_domains or ()),
                              allowed_local_path=args.allowed_local_media_path)
        return cls(processor, max_embeds, args.images_per_prompt(), media,
                   args.videos_per_prompt(), getattr(args, "media_io_threads", None))

    def process(self, prompt_token_ids: list[int], mm_data: Any
                ) -> tuple[list[int], list[MultiModalFeature]]:
        """multi_modal_data ({"image": an image or a list of them, "video": a video or a list
        of them}) -> the expanded prompt and its features; ValueError naming what is wrong.
        Videos that load() decoded may come among the images (chat sources): they are sorted
        out here."""
        images, videos = self.items_of(mm_data)
        if not images and not videos:
            return prompt_token_ids, []
        if videos:
            ids, features = self.processor.process(prompt_token_ids, images, videos)
        else:
            ids, features = self.processor.process(prompt_token_ids, images)
        for i, f in enumerate(features):
            if f.num_embeds > self.max_embeds:
                raise ValueError(f"{f.modality} {i} takes {f.num_embeds} encoder tokens, more "
                                 f"than the encoder cache holds ({self.max_embeds}); send a "
                                 f"smaller {f.modality}")
        return ids, features

    def load(self, sources: list[Any]) -> list[Any]:
        """Chat parts' sources (URLs, or image objects offline; videos as VideoSource) ->
        checked RGB images and decoded Videos; the counts are checked before anything is
        fetched or decoded."""
        num_videos = sum(isinstance(s, VideoSource) for s in sources)
        self._check_counts(len(sources) - num_videos, num_videos)
        return [self._load_one(s) for s in sources]

    def _load_one(self, source: Any) -> Any:
        if isinstance(source, VideoSource):
            value = source.value
            return (load_video(value, self.media, getattr(self.processor, "sample_frames", None))
                    if isinstance(value, str) else to_video(value, self.media))
        return (load_image(source, self.media) if isinstance(source, str)
                else check_image(source, self.media))

    def _check_counts(self, num_images: int, num_videos: int) -> None:
        if num_images > self.max_images:
            raise ValueError(f"at most {self.max_images} image(s) may be passed in one prompt "
                             f"(limit_mm_per_prompt); got {num_images}")
        if num_videos and self.video_placeholder is None:
            raise ValueError("this model does not take videos (multi_modal_data 'video')")
        if num_videos > self.max_videos:
            raise ValueError(f"at most {self.max_videos} video(s) may be passed in one prompt "
                             f"(limit_mm_per_prompt); got {num_videos}")

    def items_of(self, mm_data: Any) -> tuple[list[Any], list[Video]]:
        if not isinstance(mm_data, Mapping):
            raise ValueError("multi_modal_data must be a dict such as {'image': image}")
        unknown = sorted(set(mm_data) - {"image", "video"})
        if unknown:
            raise ValueError(f"multi_modal_data: unsupported modality {unknown[0]!r} (this "
                             "model takes 'image' and 'video')")
        images = _as_list(mm_data.get("image"), one=lambda v: hasattr(v, "shape"))
        videos = [v for v in images if isinstance(v, Video)]
        images = [v for v in images if not isinstance(v, Video)]
        videos += _as_list(mm_data.get("video"), one=_is_one_video)
        self._check_counts(len(images), len(videos))
        return ([check_image(im, self.media) for im in images],
                [to_video(v, self.media) for v in videos])

    def images_of(self, mm_data: Any) -> list[Any]:
        return self.items_of(mm_data)[0]


def _as_list(value: Any, one: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or one(value):
        return [value]  # one item (a numpy array is one image, or one video)
    return list(value)


def _is_one_video(value: Any) -> bool:
    """A Video, a [T, H, W, 3] array or a list of frames (images) is one video."""
    if isinstance(value, Video) or hasattr(value, "shape"):
        return True
    from PIL import Image

    return bool(value) and isinstance(value[0], Image.Image)
