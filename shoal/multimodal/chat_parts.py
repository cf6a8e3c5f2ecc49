"""Chat content parts (OpenAI's form) to the text a chat template renders: text parts are
joined with newlines and each image or video part becomes the model's placeholder text, its
source (a URL, or an image object offline; a video's wrapped in VideoSource) collected in
order for the processor. Shared by the server's /v1/chat/completions and the offline
LLM.chat."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# part type -> the key holding the image (vLLM's offline "image_pil" and the Responses API's
# "input_image" beside OpenAI's "image_url")
IMAGE_PARTS = {"image_url": "image_url", "image_pil": "image_pil", "input_image": "image_url"}
VIDEO_PARTS = {"video_url": "video_url"}


class Placeholders(str):
    """The image placeholder text that also carries the video one (None: the model takes no
    video), so callers that pass one placeholder string pass both."""

    video: str | None

    def __new__(cls, image: str, video: str | None = None) -> Placeholders:
        self = super().__new__(cls, image)
        self.video = video
        return self


@dataclass(frozen=True)
class VideoSource:
    """A video part's source among the image sources (a URL, or frames offline)."""

    value: Any


def content_text(parts: Sequence[Any], placeholder: str | None, sources: list[Any],
                 where: str) -> str:
    """The text of a content-part list; image sources are appended to `sources`. ValueError
    naming `where` for a part that is not text or an image, or an image part when the model
    takes none (placeholder None)."""
    texts: list[str] = []
    for part in parts:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in VIDEO_PARTS:
            video = getattr(placeholder, "video", None)
            if video is None:
                raise ValueError(f"{where}: content parts of type {kind!r} need a model that "
                                 "takes videos; this one does not")
            sources.append(VideoSource(url_source(part, kind, VIDEO_PARTS[kind], where)))
            texts.append(video)
            continue
        if kind in IMAGE_PARTS:
            if placeholder is None:
                raise ValueError(f"{where}: content parts of type {kind!r} need a model that "
                                 "takes images; this one takes text only")
            sources.append(image_source(part, kind, where))
            texts.append(placeholder)
            continue
        if kind != "text":
            raise ValueError(f"{where}: content parts of type {kind!r} are not supported; "
                             "use 'text', 'image_url' or 'video_url'")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}: a text content part needs a string 'text'")
        texts.append(part["text"])
    return "\n".join(texts)


def image_source(part: Mapping[str, Any], kind: str, where: str) -> Any:
    value = part.get(IMAGE_PARTS[kind])
    if kind == "image_pil":
        if value is None:
            raise ValueError(f"{where}: an image_pil part needs its image")
        return value
    return url_source(part, kind, IMAGE_PARTS[kind], where)


def url_source(part: Mapping[str, Any], kind: str, key: str, where: str) -> Any:
    value = part.get(key)
    if isinstance(value, Mapping):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        article = "an" if kind[0] in "aeiou" else "a"
        raise ValueError(f"{where}: {article} {kind} part needs a url (a data: URL, or http(s) / "
                         "file:// where the server allows them)")
    return value


def flatten_messages(messages: Sequence[Mapping[str, Any]], placeholder: str | None
                     ) -> tuple[list[dict[str, Any]], list[Any]]:
    """Plain-dict messages whose list contents become text (offline LLM.chat), and the image
    sources in order."""
    sources: list[Any] = []
    out = []
    for i, m in enumerate(messages):
        d = dict(m)
        content = d.get("content")
        if isinstance(content, list):
            d["content"] = content_text(content, placeholder, sources,
                                        f"messages[{i}].content")
        out.append(d)
    return out, sources
