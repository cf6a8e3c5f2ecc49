"""Loading a request's images safely: data URLs, allow-listed http(s) hosts and files under an
allowed directory (vLLM's rules: --allowed-media-domains, --allowed-local-media-path), each
bounded in encoded bytes and in pixels before anything is decoded.

This runs in the HTTP frontend: no torch here, only PIL, numpy and the standard library; PIL
is imported on first use, so a text model's server does not load it for shoal."""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
import struct
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from PIL import Image

# Formats a client may send. Restricting them keeps PIL's riskier plugins (EPS runs
# Ghostscript, and a long tail of rarely fuzzed parsers) out of reach of untrusted bytes.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")

# What PIL raises on malformed or truncated input, at open or at load.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError,
                  struct.error, zlib.error)

_MAX_REDIRECTS = 3


@dataclass(frozen=True)
class MediaSettings:
    allowed_domains: tuple[str, ...] = ()  # exact host names (lower-case compare); empty: no http(s)
    allowed_local_path: str | None = None  # a directory; None: no file:// URLs
    max_image_pixels: int = 8192 * 8192  # width*height above this: refused before decoding
    max_bytes: int = 32 * 2**20  # encoded size of one image (data URL payload, fetched body, file)
    fetch_timeout_s: float = 10.0
    max_video_bytes: int = 256 * 2**20  # encoded size of one video
    max_video_source_frames: int = 36_000  # frames decoded to sample from (20 min at 30 fps)
    max_video_frames: int = 768  # frames kept after sampling (Qwen's max_frames)
    max_video_pixels: int = 768 * 1920 * 1080  # kept frames' pixels, all together


class MediaError(ValueError):
    """Bad media from a client; the message names the problem (the server answers 400)."""


def load_image(url: str, settings: MediaSettings) -> Image.Image:
    """The RGB image a request's image URL names, fully decoded."""
    return decode_image(url_bytes(url, settings, "image"), settings)


def url_bytes(url: str, settings: MediaSettings, kind: str) -> bytes:
    """The encoded bytes a data / http(s) / file URL names, at most settings.max_bytes."""
    if not isinstance(url, str) or not url:
        raise MediaError(f"{kind} URL must be a non-empty string")
    # Only the prefix: urlsplit would copy a many-megabyte data URL to find the scheme.
    head, sep, _ = url[:16].partition(":")
    scheme = head.lower() if sep else ""
    if scheme == "data":
        data = _data_url_bytes(url, settings, kind)
    elif scheme in ("http", "https"):
        _check_http_url(url, settings)
        data = _http_get(url, settings)
    elif scheme == "file":
        data = _read_local_file(url, settings)
    else:
        raise MediaError(f"unsupported {kind} URL scheme {scheme!r}: use a data URL, "
                         "http(s) (--allowed-media-domains) or file (--allowed-local-media-path)")
    if len(data) > settings.max_bytes:
        raise MediaError(f"{kind} is {len(data)} bytes, over the limit of {settings.max_bytes}")
    return data


def decode_image(data: bytes, settings: MediaSettings) -> Image.Image:
    """Encoded image bytes to an RGB image; the size is checked from the header first."""
    from PIL import Image

    if not data:
        raise MediaError("empty image data")
    if len(data) > settings.max_bytes:
        raise MediaError(f"image is {len(data)} bytes, over the limit of {settings.max_bytes}")
    # PIL only warns between MAX_IMAGE_PIXELS and twice that; make the warning refuse too.
    # catch_warnings is process-wide, so a concurrent thread may briefly lose the filter:
    # _pixel_limit's cap on the check below refuses those images all the same.
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
                _check_pixels(img.size, _pixel_limit(settings))
                img.load()
                return _to_rgb(img)
        except MediaError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise MediaError(f"image refused as a decompression bomb: {e}") from None
        except _DECODE_ERRORS as e:
            raise MediaError(f"could not decode the image: {e}") from None


def check_image(image: Any, settings: MediaSettings) -> Image.Image:
    """An offline image (PIL, or a numpy HxWx3 uint8 array) checked and converted to RGB."""
    from PIL import Image

    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise MediaError("a numpy image must be a uint8 array of shape (height, width, 3), "
                             f"got {image.dtype} {image.shape}")
        _check_pixels((image.shape[1], image.shape[0]), settings.max_image_pixels)
        return Image.fromarray(np.ascontiguousarray(image))
    if not isinstance(image, Image.Image):
        raise MediaError(f"expected a PIL image or a numpy array, got {type(image).__name__}")
    _check_pixels(image.size, settings.max_image_pixels)
    try:
        image.load()  # an Image.open()ed file is lazy and may be truncated
        return _to_rgb(image)
    except _DECODE_ERRORS as e:
        raise MediaError(f"could not decode the image: {e}") from None


def _pixel_limit(settings: MediaSettings) -> int:
    from PIL import Image

    pil_limit = Image.MAX_IMAGE_PIXELS
    return settings.max_image_pixels if pil_limit is None else min(
        settings.max_image_pixels, pil_limit)


def _check_pixels(size: tuple[int, int], limit: int) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise MediaError(f"image has an empty size {width}x{height}")
    if width * height > limit:
        raise MediaError(f"image is {width}x{height} = {width * height} pixels, over the limit "
                         f"of {limit} pixels")


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (as vLLM does) rather than dropped,
    which would leave whatever colour the transparent pixels happen to store."""
    from PIL import Image

    if img.mode == "RGB":
        return img.copy()
    if "A" in img.getbands() or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def _data_url_bytes(url: str, settings: MediaSettings, kind: str = "image") -> bytes:
    """The payload of data:<kind>/<type>;base64,<payload>."""
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise MediaError("malformed data URL: no ',' before the payload")
    params = [p.strip().lower() for p in header.split(";")]
    mime = params[0]
    if not mime.startswith(f"{kind}/"):
        raise MediaError(f"data URL media type {mime or 'text/plain'!r} is not an {kind}"
                         if kind == "image" else
                         f"data URL media type {mime or 'text/plain'!r} is not a {kind}")
    if "base64" not in params[1:]:
        raise MediaError(f"data URL {kind}s must be base64-encoded (';base64,')")
    payload = payload.strip()
    # Refuse by the encoded length, before spending memory on decoding it.
    max_encoded = 4 * -(-settings.max_bytes // 3)
    if len(payload) > max_encoded:
        raise MediaError(f"data URL payload is {len(payload)} base64 characters, over the "
                         f"limit of {max_encoded} ({settings.max_bytes} bytes)")
    if len(payload) % 4 in (2, 3):  # clients that drop the '=' padding
        payload += "=" * (-len(payload) % 4)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"data URL payload is not valid base64: {e}") from None


def _check_http_url(url: str, settings: MediaSettings) -> None:
    """Refuses an http(s) URL unless its host is exactly one of the allowed domains."""
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url):
        raise MediaError("image URL contains whitespace or control characters")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - parsing the port validates it
    except ValueError as e:
        raise MediaError(f"malformed image URL: {e}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise MediaError(f"unsupported image URL scheme {parts.scheme!r}")
    # user@host is how "allowed.com@evil.com" smuggles another host past a naive check.
    if "@" in parts.netloc:
        raise MediaError("image URLs with user info ('user@host') are refused")
    host = (parts.hostname or "").lower()
    if not host:
        raise MediaError("image URL has no host")
    allowed = {d.strip().lower() for d in settings.allowed_domains}
    if host not in allowed:
        raise MediaError(f"image URL domain {host!r} is not allowed: the server admits only "
                         "the hosts listed in --allowed-media-domains")
    # urllib.request parses the host on its own; refuse if it disagrees with urlsplit.
    try:
        req_host = urllib.request.Request(url).host.lower()
    except ValueError as e:
        raise MediaError(f"malformed image URL: {e}") from None
    if req_host != parts.netloc.lower():
        raise MediaError(f"ambiguous host in image URL {url!r}")


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to a URL that passes the same allowlist check."""

    max_redirections = _MAX_REDIRECTS

    def __init__(self, settings: MediaSettings) -> None:
        self.settings = settings

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[override]
        try:
            _check_http_url(newurl, self.settings)
        except MediaError as e:
            fp.close()
            raise MediaError(f"redirect to {newurl!r} refused: {e}") from None
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _http_get(url: str, settings: MediaSettings) -> bytes:
    """The body of an already-checked URL, at most max_bytes, within fetch_timeout_s overall
    (urllib's timeout bounds each socket operation, not a server that trickles bytes)."""
    opener = urllib.request.build_opener(_CheckedRedirects(settings))
    deadline = time.monotonic() + settings.fetch_timeout_s
    try:
        with opener.open(url, timeout=settings.fetch_timeout_s) as resp:
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > settings.max_bytes:
                raise MediaError(f"image at {url!r} is {length} bytes, over the limit of "
                                 f"{settings.max_bytes}")
            chunks: list[bytes] = []
            total = 0
            while chunk := resp.read(min(1 << 20, settings.max_bytes + 1 - total)):
                chunks.append(chunk)
                total += len(chunk)
                if total > settings.max_bytes:
                    raise MediaError(f"image at {url!r} is over the limit of "
                                     f"{settings.max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise MediaError(f"fetching {url!r} took over {settings.fetch_timeout_s} s")
            return b"".join(chunks)
    except urllib.error.HTTPError as e:
        raise MediaError(f"could not fetch {url!r}: HTTP {e.code}") from None
    except MediaError:
        raise
    except (OSError, ValueError, EOFError) as e:  # URLError, timeouts, http.client errors
        raise MediaError(f"could not fetch {url!r}: {e}") from None


def _read_local_file(url: str, settings: MediaSettings) -> bytes:
    """A file:// URL's bytes, only from inside --allowed-local-media-path."""
    if settings.allowed_local_path is None:
        raise MediaError("file:// image URLs are refused: the server was not started with "
                         "--allowed-local-media-path")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"file:// URL names a remote host {parts.netloc!r}")
    try:
        root = os.path.realpath(settings.allowed_local_path)
        # realpath resolves '..' and every symlink, so the containment check sees the target.
        path = os.path.realpath(urllib.parse.unquote(parts.path))
    except ValueError as e:  # e.g. an embedded NUL
        raise MediaError(f"malformed file:// URL: {e}") from None
    if os.path.commonpath([root, path]) != root or path == root:
        raise MediaError("file:// URL is outside the directory set by "
                         "--allowed-local-media-path")
    return _read_regular_file(path, settings.max_bytes)


def _read_regular_file(path: str, max_bytes: int) -> bytes:
    # O_NONBLOCK: a FIFO opens without waiting for a writer (and is then refused);
    # O_NOFOLLOW: a symlink swapped in after realpath is not followed.
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise MediaError(f"image file {path!r} does not exist") from None
    except OSError as e:
        raise MediaError(f"could not open image file {path!r}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MediaError(f"{path!r} is not a regular file")
        if st.st_size > max_bytes:
            raise MediaError(f"image file {path!r} is {st.st_size} bytes, over the limit "
                             f"of {max_bytes}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)  # the file may have grown since fstat
    except OSError as e:
        raise MediaError(f"could not read image file {path!r}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise MediaError(f"image file {path!r} is over the limit of {max_bytes} bytes")
    return data
