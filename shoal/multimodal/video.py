"""Videos as frames: decoding a client's encoded video with PyAV (bounded in frames and pixels
before frames are kept), sampling it by the model's rule (by default Qwen2.5-VL's 2 frames per
second; a processor may pass its own Sampler) up to a frame count, and accepting offline
videos (a numpy [T, H, W, 3] array or a list of images, taken as frames already sampled at
the target rate).

No torch here: it runs in the HTTP frontend beside media.py (PyAV and PIL imported on use)."""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shoal.multimodal.media import MediaError, MediaSettings, check_image, url_bytes

DEFAULT_FPS = 2.0  # Qwen-VL's sampling rate (qwen-vl-utils, vLLM)

# Containers a client may send: probing stops nowhere else (PyAV would otherwise read a PNG,
# an image sequence or a playlist that names other files as a "video").
VIDEO_FORMATS = ("mov", "mp4", "m4a", "3gp", "3g2", "mj2", "matroska", "webm", "avi")


# (total frames, their rate (0: unknown), the most to keep) -> the frame indices to keep
Sampler = Callable[[int, float, int], list[int]]


@dataclass(frozen=True)
class Video:
    frames: np.ndarray  # [T, H, W, 3] uint8, RGB
    fps: float  # frames per second of `frames` (after sampling)
    times: tuple[float, ...] | None = None  # each frame's second in the source; None: i / fps

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    def frame_times(self) -> np.ndarray:
        """The second of each frame (Qwen3-VL writes them into the prompt)."""
        if self.times is not None:
            return np.asarray(self.times, dtype=np.float64)
        return np.arange(self.num_frames, dtype=np.float64) / self.fps


def retained_count(tokens_per_frame: int, num_frames: int, rate: float) -> int:
    """Tokens of a video EVS keeps at pruning rate `rate` (vLLM's rule): the floor of
    (1 - rate) of them, never fewer than the first frame's."""
    if rate <= 0:
        return tokens_per_frame * num_frames
    return max(tokens_per_frame, int(tokens_per_frame * num_frames * (1 - rate)))


def planned_counts(tokens_per_frame: int, num_frames: int, kept: int) -> list[int]:
    """Pads per frame group of a pruned video's prompt before the tower has run (Qwen3-VL,
    whose frames are separated by timestamps): the first frame whole, the rest of the `kept`
    tokens spread evenly over the later frames, earlier ones taking the remainder. Only the
    total is binding: the model lays the frames out by what EVS keeps (qwen3_vl_video.py)."""
    if not tokens_per_frame <= kept <= tokens_per_frame * num_frames:
        raise ValueError(f"kept must be in [{tokens_per_frame}, "
                         f"{tokens_per_frame * num_frames}] (got {kept})")
    if num_frames == 1:
        return [kept]
    share, extra = divmod(kept - tokens_per_frame, num_frames - 1)
    return [tokens_per_frame] + [share + (i < extra) for i in range(num_frames - 1)]


def _error(message: str) -> Exception:
    return MediaError(message)


def load_video(url: str, settings: MediaSettings, sampler: Sampler | None = None) -> Video:
    """The frames a request's video URL names, sampled by `sampler` (default: DEFAULT_FPS):
    media.py's URL rules (data URLs, allow-listed hosts, the allowed folder) with the video
    byte limit."""
    data = url_bytes(url, replace(settings, max_bytes=settings.max_video_bytes), "video")
    return decode_video(data, settings, sampler=sampler)


def sample_indices(total: int, source_fps: float, fps: float, max_frames: int) -> list[int]:
    """Frames to keep of `total` at `source_fps`: `fps` a second, evenly spread, at least one
    and at most max_frames (qwen-vl-utils' linspace over the whole clip)."""
    want = round(total / source_fps * fps) if source_fps > 0 else total
    n = max(1, min(want, max_frames, total))
    return sorted({int(round(i)) for i in np.linspace(0, total - 1, n)})


def check_frames(frames: np.ndarray, settings: MediaSettings) -> None:
    t, h, w = frames.shape[:3]
    if t <= 0 or h <= 0 or w <= 0:
        raise _error(f"video has an empty size {t}x{h}x{w}")
    if t > settings.max_video_frames:
        raise _error(f"video has {t} frames, over the limit of {settings.max_video_frames}")
    if h * w > settings.max_image_pixels:
        raise _error(f"video frames are {w}x{h} = {w * h} pixels, over the limit of "
                     f"{settings.max_image_pixels} pixels")
    if t * h * w > settings.max_video_pixels:
        raise _error(f"video is {t} frames of {w}x{h}, over the limit of "
                     f"{settings.max_video_pixels} pixels in all")


def decode_video(data: bytes, settings: MediaSettings, fps: float = DEFAULT_FPS,
                 sampler: Sampler | None = None) -> Video:
    """Encoded video bytes to frames sampled at `fps` (or by `sampler`); MediaError for
    anything that is not a whole, bounded video in an allowed container."""
    import av

    if not data:
        raise _error("empty video data")
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            if not set(container.format.name.split(",")) & set(VIDEO_FORMATS):
                raise _error(f"video container {container.format.name!r} is not accepted "
                             f"(use mp4, webm, mkv, mov or avi)")
            if not container.streams.video:
                raise _error("the file has no video stream")
            return _decode_stream(container, container.streams.video[0], settings, fps,
                                  sampler)
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError, EOFError, IndexError, MemoryError) as e:
        raise _error(f"could not decode the video: {e}") from None


def _decode_stream(container: Any, stream: Any, settings: MediaSettings, fps: float,
                   sampler: Sampler | None) -> Video:
    ctx = stream.codec_context
    if ctx.width * ctx.height > settings.max_image_pixels or ctx.width <= 0 or ctx.height <= 0:
        raise _error(f"video frames are {ctx.width}x{ctx.height}, outside 1 to "
                     f"{settings.max_image_pixels} pixels")
    total = int(stream.frames or 0)
    if total <= 0:  # no count in the header: count packets (no decoding)
        total = sum(1 for p in container.demux(stream) if p.size)
        container.seek(0, stream=stream)
    if total > settings.max_video_source_frames:
        raise _error(f"video has {total} frames, over the limit of "
                     f"{settings.max_video_source_frames}")
    rate = float(stream.average_rate or stream.guessed_rate or 0)
    if sampler is None:
        keep = sample_indices(total, rate, fps, settings.max_video_frames)
    else:
        keep = sorted(set(sampler(total, rate, settings.max_video_frames)))
        if not keep or keep[0] < 0 or keep[-1] >= total:
            raise _error(f"frame sampling chose frames outside 0 to {total - 1}")
    wanted, frames = set(keep), []
    for i, frame in enumerate(container.decode(stream)):
        if i >= settings.max_video_source_frames:
            raise _error(f"video has over {settings.max_video_source_frames} frames")
        if i in wanted:
            frames.append(frame.to_ndarray(format="rgb24"))
    if len(frames) < len(keep):
        raise _error(f"the video is truncated: {len(frames)} of {len(keep)} sampled frames "
                     "decoded")
    if any(f.shape != frames[0].shape for f in frames):
        raise _error("the video's frames change size")
    video = np.stack(frames)
    check_frames(video, settings)
    # the rate of what was kept: Qwen2.5-VL spaces its temporal positions by it
    duration = total / rate if rate > 0 else len(keep) / fps
    times = tuple(i / rate for i in keep) if rate > 0 else None
    return Video(video, len(keep) / duration, times)


def to_video(value: Any, settings: MediaSettings, fps: float = DEFAULT_FPS) -> Video:
    """An offline video: a Video, a uint8 [T, H, W, 3] array or a list of images (frames
    already sampled at `fps`), checked like a decoded one."""
    times = None
    if isinstance(value, Video):
        frames, rate, times = value.frames, value.fps, value.times
    elif isinstance(value, np.ndarray):
        frames, rate = value, fps
    elif isinstance(value, Sequence) and value:
        frames, rate = _stack_images(value), fps
    else:
        raise _error(f"a video must be a uint8 [frames, height, width, 3] array or a list of "
                     f"images, got {type(value).__name__}")
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
        raise _error("a numpy video must be a uint8 array of shape (frames, height, width, 3), "
                     f"got {frames.dtype} {frames.shape}")
    if not (math.isfinite(rate) and rate > 0):
        raise _error(f"a video's fps must be positive, got {rate}")
    check_frames(frames, settings)
    if times is not None and (len(times) != len(frames)
                              or not all(math.isfinite(t) and t >= 0 for t in times)):
        raise _error(f"a video's times must be one second >= 0 per frame ({len(frames)})")
    return Video(np.ascontiguousarray(frames), float(rate), times)


def _stack_images(images: Sequence[Any]) -> np.ndarray:
    from PIL import Image

    unbounded = MediaSettings(max_image_pixels=2**62)  # the frames are bounded below, together
    if len(images) > 100_000:
        raise _error(f"a video of {len(images)} images is too long")
    arrays = []
    for im in images:
        if not isinstance(im, (Image.Image, np.ndarray)):
            raise _error(f"video frames must be images, got {type(im).__name__}")
        arrays.append(np.asarray(check_image(im, unbounded)))
    if any(a.shape != arrays[0].shape for a in arrays):
        raise _error("a video's frames must all have one size")
    return np.stack(arrays)
