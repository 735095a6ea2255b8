"""Images through every API on a real server (its default process mode: the torch-free
HTTP frontend runs the checkpoint's processor, the engine core the vision tower): OpenAI
chat `image_url` parts with the official client, Responses `input_image`, Anthropic
`image` blocks with the official client, Ollama `images` with the official client; the
answer equals transformers' greedy answer for the same tokens and pixels. Bad images are
400s in each API's own shape, and the server keeps serving with nothing leaked."""

from __future__ import annotations

import base64
import io

import anthropic
import httpx
import numpy as np
import ollama
import openai
import pytest
import torch

from engine.multimodal.inputs import image_content_hash
from engine.multimodal.processor import ImagePromptProcessor
from tests.support.server_fixtures import (
    ServerProcess,
    build_tokenizer_dir,
    serving,
    start_echo_chat_server,
)
from tests.support.vlm_fixtures import bilevel_png, build_tiny_idefics3_checkpoint, sample_images

QUESTION = "What is in this picture?"
MAX_TOKENS = 8
EXTRA = {"ignore_eos": True}  # vLLM's: exactly MAX_TOKENS tokens


def png_base64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def data_url(image) -> str:
    return f"data:image/png;base64,{png_base64(image)}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_idefics3_checkpoint(tmp_path_factory.mktemp("vlm-server"))


@pytest.fixture(scope="module")
def server(checkpoint):
    args = ["--model", str(checkpoint), "--port", "0", "--dtype", "float32",
            "--max-model-len", "512", "--limit-mm-per-prompt", "3", "--served-model-name",
            "tiny-vlm"]
    with serving(ServerProcess(args, env={})) as proc:
        yield proc


def openai_messages(image) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": QUESTION}]}]


def hf_answer(checkpoint, image) -> tuple[str, int]:
    """transformers' greedy answer (and prompt length) for the server's own prompt: the
    checkpoint's template and processor over the same message."""
    from transformers import AutoTokenizer, Idefics3ForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        tokenize=False, add_generation_prompt=True)

    class Loaded:
        def __init__(self):
            self.image, self.content_hash = image, image_content_hash(image)

    out = ImagePromptProcessor.for_model(checkpoint).process(text, [Loaded()])
    model = Idefics3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    tensors = {name: torch.from_numpy(out.features[0].tensors[name].to_array().copy())[None]
               for name in ("pixel_values", "pixel_attention_mask")}
    with torch.inference_mode():
        generated = model.eval().generate(
            torch.tensor([out.token_ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS, pad_token_id=0, **tensors)
    answer = tokenizer.decode(generated[0, len(out.token_ids):], skip_special_tokens=True)
    return answer, len(out.token_ids)


def test_openai_chat_with_an_image_matches_transformers(server, checkpoint):
    image = sample_images()[0]
    want, num_prompt_tokens = hf_answer(checkpoint, image)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        first = client.chat.completions.create(
            model="tiny-vlm", messages=openai_messages(image), max_tokens=MAX_TOKENS,
            temperature=0, extra_body=EXTRA)
        again = client.chat.completions.create(
            model="tiny-vlm", messages=openai_messages(image), max_tokens=MAX_TOKENS,
            temperature=0, extra_body=EXTRA)
        other = client.chat.completions.create(
            model="tiny-vlm", messages=openai_messages(sample_images()[2]),
            max_tokens=MAX_TOKENS, temperature=0, extra_body=EXTRA)
        stream = client.chat.completions.create(
            model="tiny-vlm", messages=openai_messages(image), max_tokens=MAX_TOKENS,
            temperature=0, extra_body=EXTRA, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream
                           if chunk.choices)
    assert first.choices[0].message.content == want
    assert first.usage.prompt_tokens == num_prompt_tokens
    assert again.choices[0].message.content == want == streamed
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the image's blocks too
    assert other.choices[0].message.content != want


def test_every_api_gives_the_same_answer_for_the_same_image(server):
    image = sample_images()[1]
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        want = client.chat.completions.create(
            model="tiny-vlm", messages=openai_messages(image), max_tokens=MAX_TOKENS,
            temperature=0).choices[0].message.content
    responses = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": "tiny-vlm", "max_output_tokens": MAX_TOKENS, "temperature": 0,
        "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(image)},
            {"type": "input_text", "text": QUESTION}]}]})
    assert responses.status_code == 200, responses.text
    assert responses.json()["output"][-1]["content"][0]["text"] == want
    with anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0) as client:
        message = client.messages.create(
            model="tiny-vlm", max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
            messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": png_base64(image)}},
                {"type": "text", "text": QUESTION}]}])
    assert message.content[0].text == want
    reply = ollama.Client(host=server.url).chat(
        model="tiny-vlm", options={"num_predict": MAX_TOKENS, "temperature": 0},
        messages=[{"role": "user", "content": QUESTION, "images": [png_base64(image)]}])
    assert reply.message.content == want


def error_of(server, content: list[dict]) -> dict:
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-vlm", "max_tokens": 4, "messages": [{"role": "user", "content": content}]})
    assert response.status_code == 400, response.text
    return response.json()["error"]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_bad_images_are_400s_and_the_server_keeps_serving(server):
    text = {"type": "text", "text": QUESTION}
    error = error_of(server, [text, image_part("data:image/png;base64,iVBORw0KG!!!")])
    assert error["param"] == "messages[0].content[1]" and error["code"] == "invalid_image"
    error = error_of(server, [image_part("data:image/png;base64,"
                                         + base64.b64encode(b"not an image").decode())])
    assert error["code"] == "unsupported_image_format"
    bomb = base64.b64encode(bilevel_png(20_000, 20_000)).decode()
    error = error_of(server, [image_part(f"data:image/png;base64,{bomb}")])
    assert error["code"] == "image_too_large"
    error = error_of(server, [image_part(data_url(sample_images()[0]))] * 4)
    assert error["code"] == "too_many_images" and "3" in error["message"]
    error = error_of(server, [image_part("http://127.0.0.1:9/cat.png")])
    assert error["code"] == "image_url_not_allowed"
    error = error_of(server, [{"type": "image_url"}])
    assert error["param"] == "messages[0].content[0]"
    # Anthropic's error shape for a bad image block.
    response = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": "tiny-vlm", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "@@@"}}]}]})
    assert response.status_code == 400 and response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "invalid_request_error"
    # Still serving, nothing left running or holding KV blocks.
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        ok = client.chat.completions.create(model="tiny-vlm", messages=openai_messages(
            sample_images()[0]), max_tokens=2)
    assert ok.choices[0].message.content is not None
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert _metric(metrics, "pagedserve:num_requests_running") == 0
    assert _metric(metrics, "pagedserve:kv_cache_usage_perc") == 0
    assert _metric(metrics, "pagedserve:mm_images_total") >= 5
    assert _metric(metrics, "pagedserve:mm_images_encoded_total") >= 3
    assert _metric(metrics, "pagedserve:mm_encoder_cache_hits_total") >= 0


def _metric(text: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{")]
    assert values, f"{name} not exposed"
    return float(np.sum(values))


def test_a_text_only_model_refuses_images_naming_itself(tmp_path):
    server = start_echo_chat_server(build_tokenizer_dir(tmp_path))
    try:
        response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "fake-echo", "messages": [{"role": "user", "content": [
                image_part(data_url(sample_images()[0])), {"type": "text", "text": "hi"}]}]})
    finally:
        server.stop()
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "model_not_multimodal" and "fake-echo" in error["message"]
    assert error["param"] == "messages[0].content[0]"


def test_gemma3_images_through_the_server_match_transformers(tmp_path):
    """Gemma 3: the template writes <start_of_image>, the processor expands it into soft
    tokens that attend both ways; the server's greedy answer is transformers'."""
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

    from tests.support.server_fixtures import start_model_server
    from tests.support.vlm_fixtures import build_tiny_gemma3_vision_checkpoint

    checkpoint = build_tiny_gemma3_vision_checkpoint(tmp_path / "gemma3")
    image = sample_images()[0]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        tokenize=False, add_generation_prompt=True)

    class Loaded:
        def __init__(self):
            self.image, self.content_hash = image, image_content_hash(image)

    out = ImagePromptProcessor.for_model(checkpoint).process(text, [Loaded()])
    assert out.features[0].bidirectional
    ids = torch.tensor([out.token_ids])
    model = Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    pixel_values = torch.from_numpy(out.features[0].tensors["pixel_values"].to_array().copy())
    with torch.inference_mode():
        generated = model.eval().generate(
            ids, pixel_values=pixel_values,
            token_type_ids=(ids == model.config.image_token_id).long(),
            do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, pad_token_id=0)
    want = tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True)
    server = start_model_server(checkpoint, "--dtype", "float32", "--max-model-len", "256",
                                name="tiny-gemma")
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
            reply = client.chat.completions.create(
                model="tiny-gemma", messages=openai_messages(image), max_tokens=MAX_TOKENS,
                temperature=0, extra_body=EXTRA)
    finally:
        server.stop()
    assert reply.choices[0].message.content == want
    assert reply.usage.prompt_tokens == len(out.token_ids)
