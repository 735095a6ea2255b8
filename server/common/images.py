"""Images from API requests, decoded safely: every API's image input ends up here.

    OpenAI chat  image_url.url         data URL or http(s) URL  -> load_image_url
    Responses    input_image.image_url data URL or http(s) URL  -> load_image_url
    Anthropic    source base64 / url   raw base64 + media_type  -> decode_image_base64
                                       or an http(s) URL        -> load_image_url
    Ollama       images[]              raw base64               -> decode_image_base64

The pipeline, each step bounded by `ImageLimits`:

    base64 / data URL / http(s) fetch -> bytes      (size checked before decoding the base64
                                                     and while streaming the download)
    bytes -> header (Image.open is lazy)            format must be PNG, JPEG, WEBP, GIF or BMP;
                                                     width x height checked before any pixel
                                                     is decoded (decompression bombs)
    -> load -> EXIF orientation -> RGB              alpha composited on white; palette, CMYK,
                                                     16-bit and grayscale converted
    -> LoadedImage(image, content_hash, ...)        sha256 of mode, size and RGB pixels

Every failure is an `ImageInputError` whose message is for the client (what is wrong and
the limit) and whose `code` is a short string for the API's error object. Remote URLs are
off unless the server allows them; when on, a host must pass `allowed_domains`, resolve
only to public addresses (unless `allow_private_addresses`), and the connection goes to
the address that was checked (no second DNS lookup to rebind). Nothing here logs image
data. Pillow's global `Image.MAX_IMAGE_PIXELS` is left as it is; its bomb error (and its
warning, where warnings are errors) becomes "image_too_large".
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
from dataclasses import dataclass, field

import httpx
from PIL import Image, ImageOps

from engine.multimodal.inputs import image_content_hash

ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # the only Pillow plugins tried
MAX_REDIRECTS = 3
_REDIRECT_STATUSES = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class ImageLimits:
    """What the server accepts; one instance per server, from its flags."""

    max_image_bytes: int = 20 * 1024 * 1024  # encoded size (base64-decoded / downloaded)
    max_image_pixels: int = 36_000_000  # width * height after decode
    allow_remote: bool = False  # fetch http(s) URLs at all
    allowed_domains: tuple[str, ...] = ()  # when non-empty: only these hosts (or subdomains)
    allow_private_addresses: bool = False  # loopback / private / link-local / reserved targets
    fetch_timeout_s: float = 10.0  # the whole fetch, redirects included


class ImageInputError(ValueError):
    """A bad image from the client. `message` is user-facing; `code` is one of
    "invalid_image", "image_too_large", "unsupported_image_format",
    "image_url_not_allowed", "image_fetch_failed"."""

    def __init__(self, message: str, code: str = "invalid_image"):
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True)
class LoadedImage:
    """A decoded image: RGB, fully loaded. `content_hash` depends only on the pixels
    (the same pixels in PNG or BMP hash alike; one pixel changed and it differs)."""

    image: Image.Image = field(compare=False)
    content_hash: str
    width: int
    height: int
    format: str  # "PNG", "JPEG", "WEBP", "GIF", "BMP" (MPO, a phone's multi-picture JPEG: "JPEG")


# -- bytes -> image ---------------------------------------------------------------------


def decode_image_bytes(data: bytes, limits: ImageLimits) -> LoadedImage:
    """Decode an encoded image (PNG, JPEG, WEBP, GIF's first frame, BMP) into RGB.

    Raises ImageInputError: "image_too_large" (encoded bytes or width x height over the
    limits, checked before the pixels are decoded), "unsupported_image_format",
    "invalid_image" (corrupt or truncated data). CPU-bound: call it off the event loop.
    """
    if not data:
        raise ImageInputError("the image is empty")
    _check_encoded_size(len(data), limits)
    try:
        opened = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise _too_many_pixels(limits, pillow_refused=True) from exc
    except MemoryError:
        raise
    except Exception as exc:  # UnidentifiedImageError, or a header Pillow cannot parse
        kind = _sniff(data)
        if kind in ACCEPTED_FORMATS:
            raise ImageInputError(f"the {kind} image is corrupt or truncated") from exc
        raise ImageInputError(
            f"{'a ' + kind + ' image' if kind else 'the data'} is not a supported image; "
            f"accepted formats: {', '.join(ACCEPTED_FORMATS)}",
            "unsupported_image_format") from exc
    with opened:
        fmt = "JPEG" if opened.format == "MPO" else (opened.format or "unknown")
        width, height = opened.size
        if width * height > limits.max_image_pixels:
            raise _too_many_pixels(limits, width, height)
        try:
            opened.load()
            rgb = _to_rgb(_exif_upright(opened))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise _too_many_pixels(limits, pillow_refused=True) from exc
        except MemoryError:
            raise
        except Exception as exc:  # Pillow reports bad data with many exception types
            raise ImageInputError(f"the {fmt} image is corrupt or truncated") from exc
    width, height = rgb.size
    return LoadedImage(rgb, image_content_hash(rgb), width, height, fmt)


def _exif_upright(image: Image.Image) -> Image.Image:
    """The image turned as its EXIF orientation says (phone photos); a copy either way.
    Malformed EXIF is ignored, not an error: the pixels are still good."""
    try:
        return ImageOps.exif_transpose(image)
    except Exception:
        return image.copy()


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB: transparency composited on white, 16/32-bit grayscale scaled to 8 bits.
    An RGB image without transparency comes back as is (here: the upright copy)."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        image = image.point(lambda v: v / 256)  # convert() would clip 16-bit values to 255
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGB", rgba.size, (255, 255, 255))
        white.paste(rgba, mask=rgba.getchannel("A"))
        return white
    return image if image.mode == "RGB" else image.convert("RGB")


def _sniff(data: bytes) -> str | None:
    """The format named by the data's signature, for error messages only."""
    head = data[:16]
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if head.startswith(b"BM"):
        return "BMP"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "WEBP"
    if head.startswith((b"II*\x00", b"MM\x00*")):
        return "TIFF"
    if head[4:8] == b"ftyp" and head[8:12] in (b"heic", b"heix", b"mif1", b"msf1"):
        return "HEIC"
    if head[4:8] == b"ftyp" and head[8:12] in (b"avif", b"avis"):
        return "AVIF"
    return None


# -- base64 and data URLs ---------------------------------------------------------------


def decode_image_base64(data: str, limits: ImageLimits,
                        media_type: str | None = None) -> LoadedImage:
    """Decode raw base64 (no "data:" prefix), as Ollama's `images` and Anthropic's
    base64 source carry it. Whitespace and newlines are ignored; anything else outside
    the base64 alphabet is "invalid_image". The size is checked from the string's length
    before decoding. `media_type`, when given, must be image/*; the content decides the
    actual format. CPU-bound: call it off the event loop."""
    if media_type is not None and not media_type.strip().lower().startswith("image/"):
        raise ImageInputError(f"media type {_quote(media_type)} is not an image type")
    # Whitespace (line breaks every 64-76 characters) may add a few percent.
    if len(data) > _base64_length(limits.max_image_bytes) * 17 // 16 + 1024:
        raise _too_many_bytes(len(data) * 3 // 4, limits)
    compact = "".join(data.split())
    if compact[:5].lower() == "data:":
        raise ImageInputError("the image must be raw base64 without a 'data:' URL prefix")
    _check_encoded_size(len(compact) * 3 // 4 - compact[-2:].count("="), limits)
    try:
        raw = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageInputError(
            "the image's base64 data is invalid (corrupt, truncated or not base64)") from exc
    return decode_image_bytes(raw, limits)


def _decode_data_url(url: str, limits: ImageLimits) -> LoadedImage:
    """data:image/<type>;base64,<data>; any other data URL is "invalid_image"."""
    comma = url.find(",")
    if comma < 0:
        raise ImageInputError("malformed data URL: expected data:image/<type>;base64,<data>")
    media_type, *params = [p.strip().lower() for p in url[5:comma].split(";")]
    if not media_type.startswith("image/"):
        raise ImageInputError(f"the data URL's media type {_quote(media_type or 'text/plain')}"
                              " is not an image type; expected data:image/<type>;base64,<data>")
    if "base64" not in params:
        raise ImageInputError("the image data URL is not base64-encoded; "
                              "expected data:image/<type>;base64,<data>")
    if len(url) - comma > _base64_length(limits.max_image_bytes) * 17 // 16 + 1024:
        raise _too_many_bytes((len(url) - comma) * 3 // 4, limits)
    return decode_image_base64(url[comma + 1:], limits, media_type)


# -- URLs -------------------------------------------------------------------------------


async def load_image_url(url: str, limits: ImageLimits) -> LoadedImage:
    """An image from a data: URL, or from an http(s) URL when `limits.allow_remote`.

    Remote fetches: the host must be in `allowed_domains` (when set) and resolve only to
    public addresses (unless `allow_private_addresses`); at most MAX_REDIRECTS redirects,
    each target checked again; the body is read up to `max_image_bytes`; the whole fetch
    takes at most `fetch_timeout_s`. Decoding runs in a worker thread.
    Raises ImageInputError ("image_url_not_allowed", "image_fetch_failed", and the
    codes of decode_image_bytes).
    """
    url = url.strip()
    if url[:5].lower() == "data:":
        return await asyncio.to_thread(_decode_data_url, url, limits)
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    if scheme not in ("http", "https"):
        raise ImageInputError(
            f"unsupported image URL{' scheme ' + _quote(scheme) if scheme else ''}: send a "
            "base64 data URL (data:image/<type>;base64,...) or an http(s) URL",
            "image_url_not_allowed")
    if not limits.allow_remote:
        raise ImageInputError(
            "image URLs are not allowed: this server was started without remote image "
            "fetching (start it with --allow-remote-images, optionally restricted with "
            "--allowed-media-domains); send the image inline as a base64 data URL instead",
            "image_url_not_allowed")
    try:
        data = await asyncio.wait_for(_fetch(url, limits), limits.fetch_timeout_s)
    except asyncio.TimeoutError as exc:
        raise ImageInputError(
            f"fetching the image URL timed out (limit {limits.fetch_timeout_s:g} s)",
            "image_fetch_failed") from exc
    return await asyncio.to_thread(decode_image_bytes, data, limits)


async def _fetch(url: str, limits: ImageLimits) -> bytes:
    """GET `url` following up to MAX_REDIRECTS redirects by hand, each target checked."""
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False,
                                 timeout=limits.fetch_timeout_s) as client:
        target = _parse_url(url)
        for _ in range(MAX_REDIRECTS + 1):
            addresses = await _check_target(target, limits)
            result = await _get(client, target, addresses, limits)
            if isinstance(result, bytes):
                return result
            target = result  # a redirect
    raise ImageInputError(f"the image URL redirected too many times (limit {MAX_REDIRECTS})",
                          "image_fetch_failed")


async def _get(client: httpx.AsyncClient, target: httpx.URL, addresses: list[str],
               limits: ImageLimits) -> bytes | httpx.URL:
    """One GET: the body (bounded), or the redirect's target. Connects to the checked
    `addresses` in turn (Host header and TLS name stay the URL's), or by name when
    addresses is empty (no address check applies)."""
    host = target.host
    attempts = [(target, {}, {})] if not addresses else [
        (target.copy_with(host=address), {"Host": target.netloc.decode("ascii")},
         {"sni_hostname": host}) for address in addresses]
    for request_url, headers, extensions in attempts:
        try:
            async with client.stream(
                    "GET", request_url, extensions=extensions,
                    headers={**headers, "Accept-Encoding": "identity",
                             "Accept": "image/*", "User-Agent": "pagedserve"}) as response:
                if response.status_code in _REDIRECT_STATUSES:
                    location = response.headers.get("location")
                    if not location:
                        raise _fetch_failed(f"HTTP {response.status_code} without a Location")
                    return _parse_url(str(target.join(location)))
                if response.status_code != 200:
                    raise _fetch_failed(f"HTTP {response.status_code}")
                return await _read_body(response, limits)
        except httpx.ConnectError as exc:
            failure = exc  # try the host's next address
        except httpx.TimeoutException as exc:
            raise ImageInputError(
                f"fetching the image URL timed out (limit {limits.fetch_timeout_s:g} s)",
                "image_fetch_failed") from exc
        except httpx.HTTPError as exc:
            raise _fetch_failed(f"{type(exc).__name__} from {host}") from exc
    raise _fetch_failed(f"could not connect to {host}") from failure


async def _read_body(response: httpx.Response, limits: ImageLimits) -> bytes:
    """The body as sent, never more than max_image_bytes read (whatever Content-Length
    says, or without one). Compressed bodies are refused: their size is not the image's."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise _fetch_failed(f"the server sent a {encoding}-compressed body; "
                            "image URLs must be served uncompressed")
    declared = response.headers.get("content-length", "")
    if declared.isdigit():
        _check_encoded_size(int(declared), limits)
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > limits.max_image_bytes:
            raise _too_many_bytes(len(body), limits, at_least=True)
    return bytes(body)


def _parse_url(url: str) -> httpx.URL:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise ImageInputError(f"malformed image URL {_quote(url)}") from exc
    if parsed.scheme not in ("http", "https"):
        raise ImageInputError(f"unsupported image URL scheme {_quote(parsed.scheme)} "
                              "(only http and https)", "image_url_not_allowed")
    if not parsed.host:
        raise ImageInputError(f"the image URL {_quote(url)} has no host")
    return parsed


async def _check_target(target: httpx.URL, limits: ImageLimits) -> list[str]:
    """Refuse a host outside allowed_domains, or one resolving to any non-public
    address. Returns the addresses to connect to ([] when private ones are allowed:
    then the client connects by name)."""
    host = target.host.rstrip(".").lower()
    domains = [d.strip(".").lower() for d in limits.allowed_domains]
    if domains and not any(host == d or host.endswith("." + d) for d in domains):
        raise ImageInputError(
            f"image URLs from {_quote(host)} are not allowed; allowed domains: "
            f"{', '.join(domains)}", "image_url_not_allowed")
    if limits.allow_private_addresses:
        return []
    addresses = await _resolve(host, target.port or (443 if target.scheme == "https" else 80))
    if not addresses or any(not is_public_address(a) for a in addresses):
        raise ImageInputError(
            f"image URLs that resolve to private, loopback or reserved addresses are not "
            f"allowed ({_quote(host)})", "image_url_not_allowed")
    return addresses


async def _resolve(host: str, port: int) -> list[str]:
    """The host's addresses, as the connection would use them (asyncio's getaddrinfo)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise _fetch_failed(f"could not resolve the host {_quote(host)}") from exc
    return list(dict.fromkeys(info[4][0] for info in infos))


def is_public_address(address: str) -> bool:
    """True for a globally routable unicast address; False for loopback, private,
    link-local (cloud metadata), multicast, reserved, unspecified, shared (CGNAT) ones,
    IPv4-mapped IPv6 judged by its IPv4 address."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_loopback or ip.is_private or ip.is_link_local
                                 or ip.is_multicast or ip.is_reserved or ip.is_unspecified)


# -- limits and messages ----------------------------------------------------------------


def _base64_length(n_bytes: int) -> int:
    return (n_bytes + 2) // 3 * 4


def _check_encoded_size(n_bytes: int, limits: ImageLimits) -> None:
    if n_bytes > limits.max_image_bytes:
        raise _too_many_bytes(n_bytes, limits)


def _too_many_bytes(n_bytes: int, limits: ImageLimits, at_least: bool = False) -> ImageInputError:
    size = f"{'more than ' if at_least else ''}{_size(n_bytes)}"
    return ImageInputError(f"the image is too large: {size} encoded; the limit is "
                           f"{_size(limits.max_image_bytes)}", "image_too_large")


def _too_many_pixels(limits: ImageLimits, width: int = 0, height: int = 0,
                     pillow_refused: bool = False) -> ImageInputError:
    """Over max_image_pixels (from the header), or refused by Pillow's own bomb check,
    whose limit (Image.MAX_IMAGE_PIXELS) applies too where it is the lower one."""
    limit = limits.max_image_pixels
    if pillow_refused:
        limit = min(limit, Image.MAX_IMAGE_PIXELS or limit)
    size = (f"more than {limit:,} pixels" if pillow_refused
            else f"{width}x{height} = {width * height:,} pixels")
    return ImageInputError(f"the image is too large: {size}; the limit is {limit:,} pixels "
                           "(width x height)", "image_too_large")


def _fetch_failed(reason: str) -> ImageInputError:
    return ImageInputError(f"fetching the image URL failed: {reason}", "image_fetch_failed")


def _size(n_bytes: int) -> str:
    return f"{n_bytes / (1024 * 1024):.1f} MiB" if n_bytes >= 1024 * 1024 else f"{n_bytes:,} bytes"


def _quote(text: str, limit: int = 100) -> str:
    """`text` quoted for a message, cut to `limit` characters (URLs can be huge)."""
    return repr(text if len(text) <= limit else text[:limit] + "...")
