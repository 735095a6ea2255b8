"""Images in a chat request: found in the messages' content parts, checked against the
server's limits, loaded (server/common/images.py), and expanded into the prompt by the
model's processor (engine/multimodal/processor.py).

Every API reaches here through chat completions' shape: the Responses, Anthropic and
Ollama translators turn their image inputs into `image_url` parts (`image_url_part`),
so an image is loaded, limited and refused in one place, with one set of errors.

    messages[0].content = [{"type": "text", ...}, {"type": "image_url", "image_url": {"url": ...}}]
      -> chat_images(): [(0, 1, url)] -> load_chat_images(): [LoadedImage] (in order)
      -> the template writes the model's placeholder where each image part was
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from server.common.errors import APIError, bad_request
from server.common.images import ImageInputError, ImageLimits, LoadedImage, load_image_url
from server.common.lifecycle import ServerLimits

IMAGE_PART_TYPES = ("image_url",)


def image_url_part(url: str) -> dict[str, Any]:
    """A chat content part of one image (a data: or http(s) URL)."""
    return {"type": "image_url", "image_url": {"url": url}}


def data_url(media_type: str | None, base64_data: str) -> str:
    """A data URL of base64 image data (the decoder goes by the content, so a missing or
    generic media type is image/*)."""
    return f"data:{media_type or 'image/*'};base64,{base64_data}"


def part_image_url(part: Any) -> str | None:
    """The URL of an `image_url` part (a dict, or a model with `image_url`), else None."""
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    if kind not in IMAGE_PART_TYPES:
        return None
    value = part.get("image_url") if isinstance(part, dict) else getattr(part, "image_url", None)
    if isinstance(value, str):
        return value
    url = value.get("url") if isinstance(value, dict) else getattr(value, "url", None)
    return url if isinstance(url, str) else ""


def chat_images(messages: Sequence[Any]) -> list[tuple[int, int, str]]:
    """(message index, part index, url) of every image part, in prompt order."""
    found = []
    for i, message in enumerate(messages):
        content = message.content if not isinstance(message, dict) else message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                url = part_image_url(part)
                if url is not None:
                    found.append((i, j, url))
    return found


def image_limits(limits: ServerLimits) -> ImageLimits:
    """The decoder's limits from the server's flags."""
    return ImageLimits(max_image_pixels=limits.max_image_pixels,
                       allow_remote=limits.allow_remote_images
                       or bool(limits.allowed_media_domains),
                       allowed_domains=tuple(limits.allowed_media_domains))


async def load_chat_images(messages: Sequence[Any], limits: ServerLimits,
                           model_name: str, takes_images: bool) -> list[LoadedImage]:
    """The request's images, loaded concurrently, in prompt order; a 400 in the API's
    shape for a model without vision, too many images, or a bad image (naming its part:
    `messages[i].content[j]`)."""
    found = chat_images(messages)
    if not found:
        return []
    first = f"messages[{found[0][0]}].content[{found[0][1]}]"
    if not takes_images:
        raise bad_request(f"The model {model_name!r} does not take images: it is a text-only "
                          "model. Send text content only.", first, "model_not_multimodal")
    if len(found) > limits.max_images_per_prompt:
        raise bad_request(f"This request has {len(found)} images; at most "
                          f"{limits.max_images_per_prompt} are allowed per request "
                          "(--limit-mm-per-prompt).", first, "too_many_images")
    decoder_limits = image_limits(limits)

    async def load(i: int, j: int, url: str) -> LoadedImage:
        try:
            if not url:
                raise ImageInputError("the image_url part has no url")
            return await load_image_url(url, decoder_limits)
        except ImageInputError as exc:
            raise bad_request(f"Invalid image: {exc}", f"messages[{i}].content[{j}]",
                              exc.code) from None

    results = await asyncio.gather(*(load(*item) for item in found), return_exceptions=True)
    for result in results:
        if isinstance(result, APIError):
            raise result
        if isinstance(result, BaseException):
            raise result
    return list(results)
