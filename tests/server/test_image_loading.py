"""server/common/images.py: decoding, limits and remote fetches of request images.

Everything runs locally: remote fetches go to an http.server on 127.0.0.1 in a thread.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import io
import random
import resource
import socket
import threading
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from server.common import images
from server.common.images import (
    ImageInputError,
    ImageLimits,
    decode_image_base64,
    decode_image_bytes,
    is_public_address,
    load_image_url,
)
from tests.support.vlm_fixtures import bilevel_png

LIMITS = ImageLimits()
LOCAL = ImageLimits(allow_remote=True, allow_private_addresses=True)


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def _pattern(width: int = 6, height: int = 4) -> Image.Image:
    """An RGB image whose every pixel differs."""
    image = Image.new("RGB", (width, height))
    for y in range(height):
        for x in range(width):
            image.putpixel((x, y), (40 * x, 60 * y, 255 - 10 * (x + y)))
    return image


def _error(fn, *args) -> ImageInputError:
    with pytest.raises(ImageInputError) as info:
        fn(*args)
    return info.value


def _load(url: str, limits: ImageLimits = LOCAL):
    return asyncio.run(load_image_url(url, limits))


def _load_error(url: str, limits: ImageLimits = LOCAL) -> ImageInputError:
    return _error(_load, url, limits)


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _close(a: tuple, b: tuple, tolerance: int = 12) -> bool:
    return all(abs(x - y) <= tolerance for x, y in zip(a, b, strict=True))


# -- formats and pixels -----------------------------------------------------------------


@pytest.mark.parametrize("fmt, kwargs", [("PNG", {}), ("WEBP", {"lossless": True}),
                                         ("BMP", {})])
def test_lossless_round_trip(fmt, kwargs):
    source = _pattern()
    loaded = decode_image_bytes(_encode(source, fmt, **kwargs), LIMITS)
    assert (loaded.format, loaded.width, loaded.height) == (fmt, 6, 4)
    assert loaded.image.mode == "RGB" and loaded.image.size == (6, 4)
    assert loaded.image.tobytes() == source.tobytes()
    assert getattr(loaded.image, "fp", None) is None  # fully loaded, no file behind it


def test_jpeg_round_trip():
    loaded = decode_image_bytes(_encode(Image.new("RGB", (16, 16), (200, 30, 60)), "JPEG",
                                        quality=95), LIMITS)
    assert (loaded.format, loaded.image.mode, loaded.image.size) == ("JPEG", "RGB", (16, 16))
    assert _close(loaded.image.getpixel((8, 8)), (200, 30, 60))


def test_mpo_is_jpeg():
    """Phones' multi-picture JPEGs: Pillow says MPO; the first picture, as JPEG."""
    first, second = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))
    loaded = decode_image_bytes(_encode(first, "MPO", save_all=True, append_images=[second]),
                                LIMITS)
    assert loaded.format == "JPEG" and _close(loaded.image.getpixel((4, 4)), (255, 0, 0))


def test_gif_palette_and_first_frame():
    palette = Image.new("P", (4, 2))
    palette.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * 759)
    palette.putpixel((1, 0), 1)
    palette.putpixel((2, 1), 2)
    second = Image.new("P", (4, 2), 2)
    second.putpalette(palette.getpalette())
    data = _encode(palette, "GIF", save_all=True, append_images=[second])
    loaded = decode_image_bytes(data, LIMITS)
    assert loaded.format == "GIF"
    assert loaded.image.tobytes() == palette.convert("RGB").tobytes()  # frame 0, not 1
    assert decode_image_bytes(_encode(palette, "PNG"), LIMITS).content_hash == \
        loaded.content_hash


def test_hash_depends_on_pixels_only():
    source = _pattern()
    png = decode_image_bytes(_encode(source, "PNG"), LIMITS)
    bmp = decode_image_bytes(_encode(source, "BMP"), LIMITS)
    assert png.content_hash == bmp.content_hash and len(png.content_hash) == 64
    changed = source.copy()
    changed.putpixel((5, 3), (0, 0, 1))
    assert decode_image_bytes(_encode(changed, "PNG"), LIMITS).content_hash != png.content_hash
    # Same bytes, other shape: differs.
    flat = Image.frombytes("RGB", (4, 6), source.tobytes())
    assert decode_image_bytes(_encode(flat, "PNG"), LIMITS).content_hash != png.content_hash


def test_alpha_composited_on_white():
    rgba = Image.new("RGBA", (3, 1))
    rgba.putpixel((0, 0), (255, 0, 0, 0))
    rgba.putpixel((1, 0), (0, 0, 255, 255))
    rgba.putpixel((2, 0), (255, 0, 0, 128))
    image = decode_image_bytes(_encode(rgba, "PNG"), LIMITS).image
    assert image.mode == "RGB"
    assert image.getpixel((0, 0)) == (255, 255, 255)
    assert image.getpixel((1, 0)) == (0, 0, 255)
    assert _close(image.getpixel((2, 0)), (255, 127, 127), 2)
    la = Image.new("LA", (1, 1), (0, 0))
    assert decode_image_bytes(_encode(la, "PNG"), LIMITS).image.getpixel((0, 0)) == \
        (255, 255, 255)


def test_palette_transparency_composited_on_white():
    palette = Image.new("P", (2, 1))
    palette.putpalette([10, 20, 30, 200, 0, 0] + [0] * 762)
    palette.putpixel((1, 0), 1)
    image = decode_image_bytes(_encode(palette, "PNG", transparency=0), LIMITS).image
    assert image.getpixel((0, 0)) == (255, 255, 255)
    assert image.getpixel((1, 0)) == (200, 0, 0)
    gif = decode_image_bytes(_encode(palette, "GIF", transparency=0), LIMITS).image
    assert gif.getpixel((0, 0)) == (255, 255, 255) and gif.getpixel((1, 0)) == (200, 0, 0)


def test_exif_orientation_applied():
    source = Image.new("RGB", (32, 16), (255, 0, 0))
    source.paste((0, 0, 255), (16, 0, 32, 16))  # left half red, right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # display rotated 90 degrees clockwise
    loaded = decode_image_bytes(_encode(source, "JPEG", exif=exif, quality=95), LIMITS)
    assert (loaded.width, loaded.height) == (16, 32)
    assert _close(loaded.image.getpixel((8, 4)), (255, 0, 0), 40)  # left is now top
    assert _close(loaded.image.getpixel((8, 28)), (0, 0, 255), 40)


def test_other_modes_to_rgb():
    cmyk = decode_image_bytes(_encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG"),
                              LIMITS).image
    assert cmyk.mode == "RGB" and _close(cmyk.getpixel((4, 4)), (255, 0, 0), 30)
    gray16 = Image.new("I;16", (3, 1))
    for x, v in enumerate((65535, 32768, 0)):
        gray16.putpixel((x, 0), v)
    image = decode_image_bytes(_encode(gray16, "PNG"), LIMITS).image
    assert [image.getpixel((x, 0)) for x in range(3)] == [(255,) * 3, (128,) * 3, (0,) * 3]
    gray = decode_image_bytes(_encode(Image.new("L", (2, 2), 77), "PNG"), LIMITS).image
    assert gray.getpixel((1, 1)) == (77, 77, 77)
    bilevel = decode_image_bytes(_encode(Image.new("1", (9, 2), 1), "BMP"), LIMITS).image
    assert bilevel.getpixel((8, 1)) == (255, 255, 255)


# -- bad data ---------------------------------------------------------------------------


def test_truncated_png():
    data = _encode(_pattern(64, 64), "PNG")
    for cut in (len(data) // 2, 20):
        error = _error(decode_image_bytes, data[:cut], LIMITS)
        assert error.code == "invalid_image" and "PNG" in error.message
        assert "corrupt or truncated" in error.message


def test_text_and_tiff_unsupported():
    error = _error(decode_image_bytes, b"hello, this is not an image\n", LIMITS)
    assert error.code == "unsupported_image_format"
    assert "PNG, JPEG, WEBP, GIF, BMP" in error.message
    error = _error(decode_image_bytes, _encode(_pattern(), "TIFF"), LIMITS)
    assert error.code == "unsupported_image_format" and "TIFF" in error.message
    error = _error(decode_image_bytes, _encode(_pattern(), "ICO"), LIMITS)
    assert error.code == "unsupported_image_format"
    assert _error(decode_image_bytes, b"", LIMITS).code == "invalid_image"


def test_decompression_bomb_refused_quickly():
    bomb = bilevel_png(20_000, 20_000)
    assert len(bomb) < 1_000_000
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    error = _error(decode_image_bytes, bomb, LIMITS)  # Pillow's own bomb check fires first
    assert time.perf_counter() - start < 2.0
    assert error.code == "image_too_large" and "36,000,000 pixels" in error.message
    # Under Pillow's threshold, over ours: refused from the header, with the size.
    error = _error(decode_image_bytes, bilevel_png(8000, 8000), LIMITS)
    assert error.code == "image_too_large"
    assert "8000x8000" in error.message and "36,000,000 pixels" in error.message
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grown_kib < 300 * 1024  # never the 1.2 GB of RGB pixels
    # Pillow's warning threshold (Image.MAX_IMAGE_PIXELS), where warnings are errors.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        error = _error(decode_image_bytes, bilevel_png(10_000, 9_000),
                       ImageLimits(max_image_pixels=200_000_000))
    assert error.code == "image_too_large"
    assert f"{Image.MAX_IMAGE_PIXELS:,} pixels" in error.message
    # Through base64 as well, and a lower limit from the server's flags.
    small = ImageLimits(max_image_pixels=100)
    error = _error(decode_image_base64, base64.b64encode(_encode(_pattern(11, 10), "PNG"))
                   .decode(), small)
    assert error.code == "image_too_large" and "11x10 = 110 pixels" in error.message
    assert decode_image_bytes(_encode(_pattern(10, 10), "PNG"), small).width == 10


def test_encoded_size_limit(monkeypatch):
    limits = ImageLimits(max_image_bytes=1000)
    noise = Image.frombytes("RGB", (40, 40), random.Random(0).randbytes(4800))
    data = _encode(noise, "PNG")
    assert len(data) > 1000
    error = _error(decode_image_bytes, data, limits)
    assert error.code == "image_too_large" and "1,000 bytes" in error.message
    assert _error(decode_image_base64, base64.b64encode(data).decode(), limits).code == \
        "image_too_large"
    # A huge string is refused from its length: the base64 is never decoded.
    monkeypatch.setattr(images.base64, "b64decode",
                        lambda *a, **k: pytest.fail("decoded an oversized payload"))
    for text in ("A" * 2000, "A" * 1400):
        assert _error(decode_image_base64, text, limits).code == "image_too_large"
    assert _load_error("data:image/png;base64," + "A" * 2000, limits).code == "image_too_large"


# -- base64 and data URLs ---------------------------------------------------------------


def test_base64_strict_but_whitespace_tolerant():
    data = _encode(_pattern(), "PNG")
    text = base64.encodebytes(data).decode()  # a newline every 76 characters
    text = " \n" + text.replace("A", "A\r\n\t", 3) + "\n"
    assert decode_image_base64(text, LIMITS, "image/png").image.tobytes() == \
        _pattern().tobytes()
    assert decode_image_base64(base64.b64encode(data).decode(), LIMITS, "image/jpeg").format \
        == "PNG"  # the content decides, not the declared type
    for corrupt in ("iVBORw0KGgo$$$", "iVBORw0KGgoAAAANSUhEUg", "iVBOR\u00e9w0K",
                    base64.urlsafe_b64encode(b"\xfb\xff" * 30).decode()):
        error = _error(decode_image_base64, corrupt, LIMITS)
        assert error.code == "invalid_image" and "base64" in error.message
    error = _error(decode_image_base64, base64.b64encode(data).decode(), LIMITS, "text/plain")
    assert error.code == "invalid_image" and "text/plain" in error.message
    error = _error(decode_image_base64, _data_url(data), LIMITS)
    assert error.code == "invalid_image" and "data:" in error.message


def test_data_urls():
    data = _encode(_pattern(), "PNG")
    loaded = _load(_data_url(data), LIMITS)
    assert loaded.format == "PNG" and loaded.image.tobytes() == _pattern().tobytes()
    encoded = base64.encodebytes(data).decode()
    assert _load(f"data:image/png;base64,{encoded}", LIMITS).content_hash == loaded.content_hash
    assert _load(f" DATA:Image/PNG;charset=utf-8;BASE64,{encoded}\n", LIMITS).format == "PNG"
    assert _load(_data_url(data, "image/webp"), LIMITS).format == "PNG"
    error = _load_error(f"data:image/png,{encoded}", LIMITS)
    assert error.code == "invalid_image" and "not base64" in error.message
    error = _load_error(_data_url(data, "text/plain"), LIMITS)
    assert error.code == "invalid_image" and "'text/plain' is not an image type" in error.message
    error = _load_error("data:,hello", LIMITS)
    assert error.code == "invalid_image" and "not an image type" in error.message
    assert _load_error("data:image/png;base64", LIMITS).code == "invalid_image"
    assert _load_error("data:image/png;base64,@@@@", LIMITS).code == "invalid_image"


# -- remote URLs ------------------------------------------------------------------------


PNG = _encode(_pattern(), "PNG")


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None):
        self.send_response(status)
        for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
            if value is not None:
                self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        path = self.path
        if path == "/img.png":
            self._send(200, PNG, {"Content-Type": "image/png"})
        elif path.startswith("/redirect/"):  # /redirect/<n>: n hops, then the PNG
            hops = int(path.rsplit("/", 1)[1])
            self._send(302, headers={"Location": f"/redirect/{hops - 1}" if hops > 1
                                     else "/img.png"})
        elif path == "/to-file":
            self._send(302, headers={"Location": "file:///etc/passwd"})
        elif path == "/to-localhost":
            port = self.server.server_address[1]
            self._send(302, headers={"Location": f"http://localhost:{port}/img.png"})
        elif path == "/endless":  # no Content-Length: close-delimited, never ends
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(10_000):
                    self.wfile.write(b"\0" * 16384)
            except OSError:
                pass
        elif path == "/huge-length":
            self.send_response(200)
            self.send_header("Content-Length", str(10**9))
            self.end_headers()
            self.wfile.write(PNG)
        elif path == "/gzip":
            self._send(200, gzip.compress(PNG), {"Content-Encoding": "gzip"})
        elif path == "/slow":
            time.sleep(2)
            self._send(200, PNG)
        elif path == "/needs-host":  # answers only a request naming images.invalid
            ok = self.headers.get("Host", "").startswith("images.invalid:")
            self._send(200 if ok else 400, PNG if ok else b"wrong Host")
        else:
            self._send(404, b"not found")


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_remote_refused_unless_allowed(server):
    error = _load_error(f"{server}/img.png", LIMITS)
    assert error.code == "image_url_not_allowed"
    assert "--allow-remote-images" in error.message and "--allowed-media-domains" in error.message
    for url in ("file:///etc/passwd", "ftp://example.com/a.png", "/img.png", "gopher://x/"):
        assert _load_error(url, LOCAL).code == "image_url_not_allowed"


def test_remote_fetch(server):
    loaded = _load(f"{server}/img.png")
    assert loaded.format == "PNG"
    assert loaded.content_hash == decode_image_bytes(PNG, LIMITS).content_hash
    assert _load(f"{server}/redirect/3").content_hash == loaded.content_hash
    error = _load_error(f"{server}/redirect/4")
    assert error.code == "image_fetch_failed" and "redirected too many times" in error.message
    error = _load_error(f"{server}/missing.png")
    assert error.code == "image_fetch_failed" and "404" in error.message
    assert _load_error(f"{server}/to-file").code == "image_url_not_allowed"
    error = _load_error(f"{server}/gzip")
    assert error.code == "image_fetch_failed" and "gzip" in error.message


def test_remote_body_bounded(server):
    limits = ImageLimits(allow_remote=True, allow_private_addresses=True,
                         max_image_bytes=64 * 1024)
    start = time.perf_counter()
    error = _load_error(f"{server}/endless", limits)
    assert error.code == "image_too_large" and "65,536 bytes" in error.message
    error = _load_error(f"{server}/huge-length", limits)
    assert error.code == "image_too_large" and "65,536 bytes" in error.message
    assert time.perf_counter() - start < 5


def test_remote_timeout(server):
    limits = ImageLimits(allow_remote=True, allow_private_addresses=True, fetch_timeout_s=0.3)
    start = time.perf_counter()
    error = _load_error(f"{server}/slow", limits)
    assert error.code == "image_fetch_failed" and "timed out (limit 0.3 s)" in error.message
    assert time.perf_counter() - start < 1.5


def test_private_addresses_refused(server):
    port = server.rsplit(":", 1)[1]
    public_only = ImageLimits(allow_remote=True)
    for url in (f"{server}/img.png", f"http://localhost:{port}/img.png",
                f"http://[::1]:{port}/img.png", f"http://2130706433:{port}/img.png"):
        error = _load_error(url, public_only)
        assert error.code == "image_url_not_allowed" and "private" in error.message


def test_allowed_domains(server):
    port = server.rsplit(":", 1)[1]
    other = ImageLimits(allow_remote=True, allow_private_addresses=True,
                        allowed_domains=("example.com",))
    error = _load_error(f"{server}/img.png", other)
    assert error.code == "image_url_not_allowed" and "example.com" in error.message
    assert _load_error(f"http://localhost.example.org:{port}/x", other).code == \
        "image_url_not_allowed"
    this = ImageLimits(allow_remote=True, allow_private_addresses=True,
                       allowed_domains=("127.0.0.1",))
    assert _load(f"{server}/img.png", this).format == "PNG"
    # A redirect leaves the allowed hosts: refused at the hop.
    assert _load_error(f"{server}/to-localhost", this).code == "image_url_not_allowed"
    assert _load(f"http://localhost:{port}/img.png",
                 ImageLimits(allow_remote=True, allow_private_addresses=True,
                             allowed_domains=("LOCALHOST.",))).format == "PNG"


def test_connects_to_checked_address(server, monkeypatch):
    """With address checks on, the request goes to the address that was checked (a name
    nothing else can resolve), keeping the URL's Host header."""
    async def resolve(host, port):
        return {"images.invalid": ["127.0.0.1"], "mixed.invalid": ["93.184.216.34",
                                                                   "10.0.0.1"]}[host]
    monkeypatch.setattr(images, "_resolve", resolve)
    monkeypatch.setattr(images, "is_public_address", lambda a: not a.startswith("10."))
    port = server.rsplit(":", 1)[1]
    loaded = _load(f"http://images.invalid:{port}/needs-host", ImageLimits(allow_remote=True))
    assert loaded.content_hash == decode_image_bytes(PNG, LIMITS).content_hash
    # Any one non-public address refuses the host.
    error = _load_error(f"http://mixed.invalid:{port}/img.png", ImageLimits(allow_remote=True))
    assert error.code == "image_url_not_allowed"


def test_unresolvable_host(monkeypatch):
    async def getaddrinfo(self, host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    monkeypatch.setattr(asyncio.base_events.BaseEventLoop, "getaddrinfo", getaddrinfo)
    error = _load_error("http://no-such-host.invalid/x.png", ImageLimits(allow_remote=True))
    assert error.code == "image_fetch_failed" and "resolve" in error.message


@pytest.mark.parametrize("address, public", [
    ("93.184.216.34", True), ("2606:4700:4700::1111", True), ("8.8.8.8", True),
    ("127.0.0.1", False), ("10.1.2.3", False), ("192.168.0.1", False), ("172.16.0.1", False),
    ("169.254.169.254", False), ("100.100.100.200", False), ("0.0.0.0", False),
    ("224.0.0.1", False), ("240.0.0.1", False), ("255.255.255.255", False), ("::1", False),
    ("::", False), ("fe80::1%eth0", False), ("fc00::1", False), ("ff02::1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False), ("not an address", False),
])
def test_is_public_address(address, public):
    assert is_public_address(address) is public
