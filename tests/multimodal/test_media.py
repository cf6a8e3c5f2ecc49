"""shoal.multimodal.media: data URLs, allow-listed http(s) and file:// loading, and the size
and decode checks. The network tests use a local http.server only; the refusals prove that no
connection is attempted."""

from __future__ import annotations

import base64
import http.server
import io
import os
import socket
import struct
import threading
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from shoal.multimodal import media
from shoal.multimodal.media import MediaError, MediaSettings, check_image, decode_image, load_image

DEFAULT = MediaSettings()


def _pixels(w: int = 8, h: int = 6) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def _png(w: int = 8, h: int = 6) -> bytes:
    return _encode(Image.fromarray(_pixels(w, h)), "PNG")


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height over a tiny IDAT: cheap to build, and any
    attempt to decode it fails as truncated, so a size error proves the header check ran."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


# ---- data URLs and decoding -------------------------------------------------------------------

def test_png_data_url_round_trip() -> None:
    img = load_image(_data_url(_png()), DEFAULT)
    assert img.mode == "RGB" and img.size == (8, 6)
    np.testing.assert_array_equal(np.asarray(img), _pixels())


@pytest.mark.parametrize("fmt,mime", [("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                                      ("GIF", "image/gif"), ("BMP", "image/bmp")])
def test_other_formats_decode(fmt: str, mime: str) -> None:
    try:
        data = _encode(Image.fromarray(_pixels(16, 12)), fmt)
    except (OSError, KeyError):
        pytest.skip(f"PIL here cannot write {fmt}")
    img = load_image(_data_url(data, mime), DEFAULT)
    assert img.mode == "RGB" and img.size == (16, 12)


def test_data_url_without_padding_is_accepted() -> None:
    url = _data_url(_png()).rstrip("=")
    assert load_image(url, DEFAULT).size == (8, 6)


@pytest.mark.parametrize("url,problem", [
    ("data:image/png;base64,@@not base64@@", "not valid base64"),
    ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), "not an image"),
    ("data:;base64," + base64.b64encode(b"hello").decode(), "not an image"),
    ("data:image/png," + "x" * 8, "base64-encoded"),
    ("data:image/png;base64", "malformed data URL"),
])
def test_bad_data_urls(url: str, problem: str) -> None:
    with pytest.raises(MediaError, match=problem):
        load_image(url, DEFAULT)


def test_data_url_over_max_bytes_is_refused_before_decoding(monkeypatch) -> None:
    def no_decode(*args, **kwargs):
        pytest.fail("the payload was decoded before its length was checked")

    monkeypatch.setattr(media.base64, "b64decode", no_decode)
    with pytest.raises(MediaError, match="over the limit"):
        load_image(_data_url(_png()), MediaSettings(max_bytes=64))


@pytest.mark.parametrize("payload", [os.urandom(512), b"just some text, not an image"])
def test_non_image_payload(payload: bytes) -> None:
    with pytest.raises(MediaError, match="could not decode the image"):
        load_image(_data_url(payload), DEFAULT)


def test_format_outside_the_allowed_list_is_refused() -> None:
    ppm = _encode(Image.fromarray(_pixels()), "PPM")  # PIL reads it, but we don't admit it
    with pytest.raises(MediaError, match="could not decode the image"):
        decode_image(ppm, DEFAULT)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_image(fmt: str) -> None:
    data = _encode(Image.fromarray(_pixels(64, 64)), fmt)
    with pytest.raises(MediaError, match="could not decode the image"):
        decode_image(data[: len(data) // 2], DEFAULT)


def test_pixel_limit_checked_from_the_header() -> None:
    with pytest.raises(MediaError, match=r"9000x9000 = 81000000 pixels.*limit of 67108864"):
        decode_image(_png_header(9000, 9000), DEFAULT)
    with pytest.raises(MediaError, match=r"20x20 = 400 pixels.*limit of 100"):
        decode_image(_png(20, 20), MediaSettings(max_image_pixels=100))


def test_huge_image_is_refused() -> None:
    # Beyond PIL's own limit its check (at open) fires first; the message still gives both.
    with pytest.raises(MediaError, match=r"400000000 pixels.*exceeds limit"):
        decode_image(_png_header(20000, 20000), DEFAULT)


@pytest.mark.parametrize("side", [20000, 10000])  # PIL's error, and its warning made an error
def test_pil_decompression_bomb_check_is_a_media_error(side: int) -> None:
    generous = MediaSettings(max_image_pixels=10**12)
    with pytest.raises(MediaError, match="decompression bomb"):
        decode_image(_png_header(side, side), generous)


def test_decode_image_byte_limit_and_empty() -> None:
    with pytest.raises(MediaError, match="over the limit"):
        decode_image(_png(), MediaSettings(max_bytes=16))
    with pytest.raises(MediaError, match="empty"):
        decode_image(b"", DEFAULT)


@pytest.mark.parametrize("mode", ["RGBA", "L", "P", "LA", "CMYK", "I;16"])
def test_modes_become_rgb(mode: str) -> None:
    src = Image.fromarray(_pixels()).convert(mode) if mode != "I;16" else Image.new(mode, (8, 6))
    img = decode_image(_encode(src, "TIFF" if mode == "CMYK" else "PNG"), DEFAULT)
    assert img.mode == "RGB" and img.size == (8, 6)


def test_transparency_is_composited_onto_white() -> None:
    rgba = Image.new("RGBA", (2, 1), (10, 20, 30, 0))
    rgba.putpixel((1, 0), (10, 20, 30, 255))
    img = decode_image(_encode(rgba, "PNG"), DEFAULT)
    assert img.getpixel((0, 0)) == (255, 255, 255)
    assert img.getpixel((1, 0)) == (10, 20, 30)


# ---- http(s) --------------------------------------------------------------------------------

ALLOW = MediaSettings(allowed_domains=("allowed.com",))


@pytest.fixture
def no_network(monkeypatch) -> None:
    """Fails the test on any fetch, DNS lookup or connection."""
    def boom(*args, **kwargs):
        pytest.fail("a network access was attempted")

    monkeypatch.setattr(media, "_http_get", boom)
    monkeypatch.setattr(socket, "getaddrinfo", boom)
    monkeypatch.setattr(socket, "create_connection", boom)


@pytest.mark.parametrize("url,problem", [
    ("http://169.254.169.254/latest/meta-data", "--allowed-media-domains"),
    ("http://localhost:8000/x", "--allowed-media-domains"),
    ("http://127.0.0.1/", "--allowed-media-domains"),
    ("http://[::1]/", "--allowed-media-domains"),
    ("http://evil.com/?u=allowed.com", "--allowed-media-domains"),
    ("https://allowed.com.evil.com/x.png", "--allowed-media-domains"),
    ("http://evil.com#@allowed.com", "--allowed-media-domains"),
    ("http://allowed.com@evil.com/", "user info"),
    ("http://user:pw@allowed.com/", "user info"),
    ("http://allowed.com\\@evil.com/", "user info"),
    ("http://allowed.com:99999/", "malformed"),
    ("http://allowed.com/a b", "whitespace or control"),
    ("http://allowed.com/\nHost: evil.com", "whitespace or control"),
    ("http:///x.png", "no host"),
])
def test_http_refusals_touch_no_network(no_network, url: str, problem: str) -> None:
    with pytest.raises(MediaError, match=problem):
        load_image(url, ALLOW)


def test_http_refused_by_default(no_network) -> None:
    with pytest.raises(MediaError, match="--allowed-media-domains"):
        load_image("https://allowed.com/x.png", DEFAULT)


def test_allowed_domain_compare_ignores_case(monkeypatch) -> None:
    monkeypatch.setattr(media, "_http_get", lambda url, settings: _png())
    settings = MediaSettings(allowed_domains=("Allowed.COM",))
    assert load_image("https://ALLOWED.com:8443/x.png", settings).size == (8, 6)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        png = _png()
        routes = {
            "/img.png": (200, {"Content-Length": str(len(png))}, png),
            "/big": (200, {"Content-Length": str(4096)}, b"\0" * 4096),
            "/big-nolen": (200, {}, b"\0" * 4096),
            "/moved": (302, {"Location": "/img.png", "Content-Length": "0"}, b""),
            "/evil": (302, {"Location": "http://evil.example/x.png", "Content-Length": "0"},
                      b""),
            "/ftp": (302, {"Location": "ftp://127.0.0.1/x.png", "Content-Length": "0"}, b""),
        }
        code, headers, body = routes.get(self.path, (404, {"Content-Length": "0"}, b""))
        self.send_response(code)
        for key, value in headers.items():
            self.send_header(key, value)
        if "Content-Length" not in headers:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


LOCAL = MediaSettings(allowed_domains=("127.0.0.1",), max_bytes=2048, fetch_timeout_s=5.0)


@pytest.fixture
def no_proxy(monkeypatch) -> None:
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)


def test_fetch_from_allowed_host(no_proxy, server: str) -> None:
    img = load_image(f"{server}/img.png", LOCAL)
    np.testing.assert_array_equal(np.asarray(img), _pixels())


def test_redirect_within_allowed_host_is_followed(no_proxy, server: str) -> None:
    assert load_image(f"{server}/moved", LOCAL).size == (8, 6)


@pytest.mark.parametrize("path", ["/evil", "/ftp"])
def test_redirect_to_other_host_is_refused(no_proxy, server: str, path: str,
                                           monkeypatch) -> None:
    real = socket.getaddrinfo

    def only_local(host, *args, **kwargs):
        assert host == "127.0.0.1", f"redirect target {host} was resolved"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", only_local)
    with pytest.raises(MediaError, match="redirect to .* refused"):
        load_image(f"{server}{path}", LOCAL)


@pytest.mark.parametrize("path", ["/big", "/big-nolen"])
def test_fetched_body_over_max_bytes(no_proxy, server: str, path: str) -> None:
    with pytest.raises(MediaError, match="over the limit"):
        load_image(f"{server}{path}", LOCAL)


def test_fetch_http_error(no_proxy, server: str) -> None:
    with pytest.raises(MediaError, match="HTTP 404"):
        load_image(f"{server}/missing.png", LOCAL)


# ---- file:// --------------------------------------------------------------------------------

@pytest.fixture
def media_dir(tmp_path) -> tuple[str, MediaSettings]:
    root = tmp_path / "allowed"
    root.mkdir()
    (root / "img.png").write_bytes(_png())
    (tmp_path / "secret.png").write_bytes(_png())
    return str(root), MediaSettings(allowed_local_path=str(root), max_bytes=4096)


def test_file_url_refused_by_default(tmp_path) -> None:
    (tmp_path / "img.png").write_bytes(_png())
    with pytest.raises(MediaError, match="--allowed-local-media-path"):
        load_image(f"file://{tmp_path}/img.png", DEFAULT)


def test_file_url_inside_allowed_path(media_dir) -> None:
    root, settings = media_dir
    img = load_image(f"file://{root}/img.png", settings)
    np.testing.assert_array_equal(np.asarray(img), _pixels())
    os.symlink(f"{root}/img.png", f"{root}/link.png")  # a symlink that stays inside is fine
    assert load_image(f"file://localhost{root}/link.png", settings).size == (8, 6)


def test_file_url_escapes_are_refused(media_dir) -> None:
    root, settings = media_dir
    os.symlink(f"{root}/../secret.png", f"{root}/out.png")
    os.mkdir(f"{root}2")  # shares the allowed dir's name as a prefix
    for url in (f"file://{root}/../secret.png", f"file://{root}/%2e%2e/secret.png",
                f"file://{root}/out.png", f"file://{root}2/img.png", f"file://{root}",
                "file:///etc/passwd"):
        with pytest.raises(MediaError, match="outside the directory"):
            load_image(url, settings)


def test_file_url_other_problems(media_dir) -> None:
    root, settings = media_dir
    (Image.fromarray(_pixels(256, 256))).save(f"{root}/big.png")
    os.mkdir(f"{root}/sub")
    os.mkfifo(f"{root}/fifo")  # would block a plain open() forever
    for url, problem in [(f"file://{root}/missing.png", "does not exist"),
                         (f"file://{root}/big.png", "over the limit"),
                         (f"file://{root}/sub", "not a regular file"),
                         (f"file://{root}/fifo", "not a regular file"),
                         (f"file://evil.com{root}/img.png", "remote host"),
                         (f"file://{root}/a%00b.png", "malformed")]:
        with pytest.raises(MediaError, match=problem):
            load_image(url, settings)


@pytest.mark.parametrize("url", ["ftp://allowed.com/x.png", "javascript:alert(1)",
                                 "/etc/passwd", "img.png", "C:\\img.png", "gopher://x/", ""])
def test_other_schemes_are_refused(no_network, url: str) -> None:
    with pytest.raises(MediaError):
        load_image(url, MediaSettings(allowed_domains=("allowed.com",),
                                      allowed_local_path="/"))


# ---- check_image (offline API) --------------------------------------------------------------

@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_check_image_pil(mode: str) -> None:
    src = Image.fromarray(_pixels()).convert(mode)
    img = check_image(src, DEFAULT)
    assert img.mode == "RGB" and img.size == (8, 6)
    assert src.mode == mode  # the caller's image is left alone
    if mode == "RGB":
        np.testing.assert_array_equal(np.asarray(img), _pixels())


def test_check_image_numpy() -> None:
    img = check_image(_pixels(), DEFAULT)
    assert img.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(img), _pixels())


@pytest.mark.parametrize("bad", [_pixels().astype(np.float32), _pixels()[:, :, 0],
                                 np.zeros((4, 4, 4), np.uint8)])
def test_check_image_bad_arrays(bad: np.ndarray) -> None:
    with pytest.raises(MediaError, match="uint8 array of shape"):
        check_image(bad, DEFAULT)


@pytest.mark.parametrize("bad", [None, "img.png", _png(), [[1, 2, 3]], object()])
def test_check_image_non_images(bad: object) -> None:
    with pytest.raises(MediaError, match="expected a PIL image"):
        check_image(bad, DEFAULT)


def test_check_image_oversize_and_truncated() -> None:
    small = MediaSettings(max_image_pixels=47)
    for image in (Image.fromarray(_pixels()), _pixels()):
        with pytest.raises(MediaError, match=r"8x6 = 48 pixels.*limit of 47"):
            check_image(image, small)
    data = _png(64, 64)
    lazy = Image.open(io.BytesIO(data[: len(data) // 2]))
    with pytest.raises(MediaError, match="could not decode the image"):
        check_image(lazy, DEFAULT)
