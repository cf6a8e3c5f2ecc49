"""The frontend's side of images: checks what a prompt carries (count, kind, size), runs the
model's processor (placeholders expanded, tensors made) and sizes each image against the
engine's encoder cache. Runs where the tokenizer runs, never in the engine core."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shoal.multimodal.inputs import MultiModalFeature
from shoal.multimodal.media import MediaSettings, check_image, load_image
from shoal.multimodal.processors import processor_class


class MultiModalFrontend:
    def __init__(self, processor: Any, max_embeds: int, max_images: int,
                 media: MediaSettings):
        self.processor = processor
        self.max_embeds = max_embeds  # the engine's encoder cache: the largest image
        self.max_images = max_images
        self.media = media

    @property
    def image_placeholder(self) -> str:
        return self.processor.image_placeholder

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
        media = MediaSettings(allowed_domains=tuple(args.allowed_media_domains or ()),
                              allowed_local_path=args.allowed_local_media_path)
        return cls(processor, max_embeds, args.images_per_prompt(), media)

    def process(self, prompt_token_ids: list[int], mm_data: Any
                ) -> tuple[list[int], list[MultiModalFeature]]:
        """multi_modal_data ({"image": an image or a list of them}) -> the expanded prompt
        and its features; ValueError naming what is wrong."""
        images = self.images_of(mm_data)
        if not images:
            return prompt_token_ids, []
        ids, features = self.processor.process(prompt_token_ids, images)
        for i, f in enumerate(features):
            if f.num_embeds > self.max_embeds:
                raise ValueError(f"image {i} takes {f.num_embeds} encoder tokens, more than "
                                 f"the encoder cache holds ({self.max_embeds}); send a "
                                 "smaller image")
        return ids, features

    def load(self, sources: list[Any]) -> list[Any]:
        """Chat image parts' sources (URLs, or image objects offline) -> checked RGB images;
        the count is checked before anything is fetched or decoded."""
        if len(sources) > self.max_images:
            raise ValueError(f"at most {self.max_images} image(s) may be passed in one prompt "
                             f"(limit_mm_per_prompt); got {len(sources)}")
        return [load_image(s, self.media) if isinstance(s, str) else check_image(s, self.media)
                for s in sources]

    def images_of(self, mm_data: Any) -> list[Any]:
        if not isinstance(mm_data, Mapping):
            raise ValueError("multi_modal_data must be a dict such as {'image': image}")
        unknown = sorted(set(mm_data) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data: unsupported modality {unknown[0]!r} (this "
                             "model takes 'image')")
        images = mm_data.get("image")
        if images is None:
            return []
        if not isinstance(images, Sequence) or hasattr(images, "shape"):
            images = [images]  # one image (a numpy array is an image, not a list)
        images = list(images)
        if len(images) > self.max_images:
            raise ValueError(f"at most {self.max_images} image(s) may be passed in one prompt "
                             f"(limit_mm_per_prompt); got {len(images)}")
        return [check_image(im, self.media) for im in images]
