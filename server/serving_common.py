"""Helpers shared by the completion and chat handlers: model check, prompt handling,
sampling parameters, SSE framing, stream merging, disconnect handling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from engine.frontend.processor import check_prompt
from engine.request_output import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams
from server.errors import APIError, bad_request, from_exception, validation_error
from server.lifecycle import ActiveRequest
from server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    PromptTokensDetails,
    SamplingFields,
    UsageInfo,
)
from server.state import ServerState
from server.tools import template_tool_calls

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"
LOGPROB_FLOOR = -9999.0  # -inf is not JSON
# The sampler works in float32: a top_p that rounds to 0 there keeps no token at all.
_MIN_TOP_P = 1e-30


def json_logprob(value: float) -> float:
    """A logprob JSON can carry: -inf and NaN (degenerate logits) become the floor."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


# Characters that JSON leaves raw but Python's str.splitlines (and so httpx's iter_lines,
# and many line-based SSE readers) treats as line breaks: one in a token would cut an
# event in two for those clients. Escaped, the JSON value is the same.
_LINE_BREAKS_JSON_KEEPS = {"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def sse(data_json: str) -> str:
    r"""One SSE event carrying `data_json`, safe for line-splitting clients.

    Example: {"c":"a<U+2028>b"} -> data: {"c":"a\u2028b"}  (then a blank line).
    """
    if not data_json.isascii():
        for raw, escaped in _LINE_BREAKS_JSON_KEEPS.items():
            if raw in data_json:
                data_json = data_json.replace(raw, escaped)
    return f"data: {data_json}\n\n"


def json_string(text: str) -> str:
    """`text` as a JSON string literal, escaped exactly as pydantic's model_dump_json
    escapes it (quotes, backslashes, control characters; non-ASCII kept as is)."""
    return msgspec.json.encode(text).decode()


class StreamChunkWriter:
    """The SSE events of one streamed response (completion or chat chunks).

    Nearly every chunk is one unfinished choice with a plain delta and no logprobs:
    those are written from a template around the request's fixed fields, byte for
    byte what the pydantic model writes (tests/unit/server/test_server_units.py checks each
    subclass) at a fraction of its cost; any other chunk goes through
    `response_type`. Subclasses set `object_name` and `response_type`.
    """

    object_name: str
    response_type: type

    def __init__(self, request_id: str, created: int, model: str):
        self.request_id, self.created, self.model = request_id, created, model
        self._head = (f'{{"id":{json_string(request_id)},"object":"{self.object_name}",'
                      f'"created":{int(created)},"model":{json_string(model)},'
                      '"choices":[{"index":')

    def _templated(self, index: int, delta_fields: str) -> str:
        """data: {... one choice: `index`, `delta_fields` (JSON members), no logprobs,
        unfinished; no usage}"""
        return sse(f'{self._head}{index},{delta_fields},"logprobs":null,'
                   '"finish_reason":null,"stop_reason":null}],"usage":null}')

    def _response(self, choices: list) -> str:
        return sse(self.response_type(
            id=self.request_id, created=self.created, model=self.model, choices=choices,
        ).model_dump_json())


def sse_error(exc: BaseException) -> str:
    """An error as one SSE data line (the stream then ends with [DONE])."""
    return sse(from_exception(exc).to_json())


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.served_model_names:
        raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


def check_common(state: ServerState, body: SamplingFields, unsupported: tuple[str, str] | None):
    check_model(state, body.model)
    if unsupported is not None:
        param, message = unsupported
        raise bad_request(message, param, "unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true.",
                          "stream_options", "invalid_value")
    if body.priority != 0 and state.scheduling_policy != "priority":
        raise bad_request("priority is only honoured when the server runs with "
                          "--scheduling-policy priority.", "priority", "unsupported_parameter")
    max_n = state.limits.max_n
    if body.n > max_n:
        raise bad_request(f"n must be at most {max_n} on this server (--max-n), got {body.n}.",
                          "n", "invalid_value")


def build_sampling_params(
    state: ServerState,
    body: SamplingFields,
    *,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The request's SamplingParams; a bad value is a 400 naming its field."""
    max_logprobs = state.limits.max_logprobs
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and value > max_logprobs:
            raise bad_request(f"{name} must be between 0 and {max_logprobs}, got {value}.",
                              name, "invalid_value")
    if body.top_p is not None and 0.0 < body.top_p < _MIN_TOP_P:
        raise bad_request(f"top_p must be at least {_MIN_TOP_P:g} (or use top_k=1), got "
                          f"{body.top_p}.", "top_p", "invalid_value")
    logit_bias = None
    if body.logit_bias:
        logit_bias = {}
        for key, bias in body.logit_bias.items():
            try:
                logit_bias[int(key)] = float(bias)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}.",
                                  "logit_bias", "invalid_value") from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    stop_token_ids = list(body.stop_token_ids or [])
    if not body.ignore_eos:  # the model's other end-of-sequence ids act like EOS
        for token_id in state.extra_stop_token_ids:
            if token_id not in stop_token_ids:
                stop_token_ids.append(token_id)
    try:
        return SamplingParams(
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            seed=body.seed,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=logit_bias,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            structured_outputs=structured_outputs,
        )
    except Exception as exc:  # SamplingParamsError -> 400 naming the field
        if body.max_completion_tokens is not None and getattr(exc, "param", "") == "max_tokens":
            exc.param = "max_completion_tokens"
        raise from_exception(exc) from exc


def check_prompts(state: ServerState, prompts: Sequence[list[int]], params: SamplingParams,
                  body: SamplingFields, prompt_param: str = "prompt") -> None:
    """Validate every prompt before anything starts (a batch fails as a whole).

    Errors name the request's own fields (`prompt_param`; max_completion_tokens
    when the request used it).
    """
    engine = state.engine
    for prompt_token_ids in prompts:
        try:
            check_prompt(prompt_token_ids, params, engine.max_model_len, engine.vocab_size)
        except Exception as exc:
            error = from_exception(exc)
            if error.param == "prompt":
                error.param = prompt_param
            elif error.param == "max_tokens" and body.max_completion_tokens is not None:
                error.param = "max_completion_tokens"
            raise error from exc


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """A ChatCompletionRequest from another API's translated fields; a 400 if invalid."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(RequestValidationError(exc.errors())) from None


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "\n".join(part.text or "" for part in message.content)


# chat_template_kwargs: at most this much JSON, and never a name the server sets itself.
MAX_TEMPLATE_KWARGS_CHARS = 16 * 1024
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
    "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask",
})


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs`, checked: a 400 when too large or naming a reserved argument."""
    if not kwargs:
        return {}
    if len(json.dumps(kwargs)) > MAX_TEMPLATE_KWARGS_CHARS:
        raise bad_request(f"chat_template_kwargs is larger than {MAX_TEMPLATE_KWARGS_CHARS} "
                          "characters of JSON.", "chat_template_kwargs", "invalid_value")
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}.",
                          "chat_template_kwargs", "invalid_value")
    return kwargs


def apply_chat_template(state: ServerState, messages: Sequence[ChatMessage],
                        add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None,
                        template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """Render the messages with the model's chat template; returns (text, token ids).

    Assistant turns keep their `tool_calls` and tool turns their `tool_call_id`;
    `tools` and `template_kwargs` are passed to the template.
    """
    tokenizer = state.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("This model has no chat template; use /v1/completions.", "messages")
    conversation = []
    for message in messages:
        turn: dict[str, Any] = {"role": message.role, "content": message_text(message)}
        if message.name:
            turn["name"] = message.name  # for templates that use it
        if message.tool_calls:
            turn["tool_calls"] = template_tool_calls(message.tool_calls)
        if message.tool_call_id is not None:
            turn["tool_call_id"] = message.tool_call_id
        conversation.append(turn)
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
            tools=tools or None, **(template_kwargs or {}))
    except Exception as exc:  # a template may raise on e.g. roles it does not accept
        raise bad_request(f"The chat template rejected the messages: {exc}", "messages") from exc
    # The template already wrote any BOS it wants.
    return text, list(tokenizer(text, add_special_tokens=False).input_ids)


def make_usage(outputs: Sequence[RequestOutput | None]) -> UsageInfo:
    prompt_tokens = sum(o.num_prompt_tokens for o in outputs if o is not None)
    completion_tokens = sum(o.num_generation_tokens for o in outputs if o is not None)
    cached = sum(o.num_cached_tokens for o in outputs if o is not None)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def record_usage(raw_request: Request, usage: UsageInfo) -> None:
    """Tell the access log how many tokens this request used."""
    raw_request.state.usage = usage


def record_user(raw_request: Request, body: SamplingFields) -> None:
    """Tell the access log the request's `user` (the only thing `user` is used for)."""
    if body.user:
        raw_request.state.user = body.user


def usage_chunk_for(body: SamplingFields, response_type: type, state: ServerState,
                    request_id: str, created: int) -> Callable[[UsageInfo], str] | None:
    """The stream's last chunk (`choices: []`, the usage), if `stream_options` asks for it."""
    if body.stream_options is None or not body.stream_options.include_usage:
        return None

    def chunk(usage: UsageInfo) -> str:
        return sse(response_type(id=request_id, created=created, model=state.model_name,
                                 choices=[], usage=usage).model_dump_json())
    return chunk


async def sse_body(
    state: ServerState,
    raw_request: Request,
    active: ActiveRequest,
    chunks: AsyncIterator[str],
    finals: list[RequestOutput | None],
    usage_chunk: Callable[[UsageInfo], str] | None,
) -> AsyncIterator[str]:
    """The frame every streamed response shares, around the endpoint's own `chunks`.

    After the chunks (which leave each prompt's last RequestOutput in `finals`):
    the usage for the access log, a usage chunk when the client asked for one
    (`usage_chunk`), the error of a server-side abort (deadline, shutdown). Any
    exception becomes an in-band error event. Always ends with [DONE].
    """
    try:
        async with contextlib.aclosing(chunks):
            async for event in chunks:
                yield event
        usage = make_usage(finals)
        record_usage(raw_request, usage)
        if usage_chunk is not None:
            yield usage_chunk(usage)
        if (error := active.error()) is not None:
            raw_request.state.stream_error = True
            yield sse(error.to_json())
    except Exception as exc:  # noqa: BLE001 - the error goes to the client in-band
        raw_request.state.stream_error = True
        state.metrics.record_error(exc)  # e.g. a dead engine (not the engine's own failures)
        yield sse_error(exc)
    yield SSE_DONE


async def merge_streams(
    iterators: Sequence[AsyncIterator[T]],
) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as (iterator index, item), as items arrive.

    Closing the merged iterator (or an error in one of them) cancels and closes all
    of them, which aborts their requests.
    """
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await _aclose(iterators[0])
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def drain(index: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                await queue.put((index, item, None, False))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((index, None, exc, True))
            return
        await queue.put((index, None, None, True))

    tasks = [asyncio.ensure_future(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, error, done = await queue.get()
            if error is not None:
                raise error
            if done:
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for iterator in iterators:
            await _aclose(iterator)


async def _aclose(iterator: Any) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


async def collect_final(raw_request: Request, active: ActiveRequest) -> RequestOutput:
    """The last RequestOutput of a one-prompt request (not streamed); finishes `active`.

    Raises ClientDisconnected when the client leaves, or the server's abort error
    (deadline, shutdown).
    """
    async def collect() -> RequestOutput:
        final = None
        async for output in active.streams[0]:
            final = output
        return final

    try:
        final = await run_until_disconnect(raw_request, collect())
    finally:
        await active.finish()
    if (error := active.error()) is not None:
        raise error
    return final


class ClientDisconnected(Exception):
    pass


class EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that always ends its request: when the stream completes, when
    the client disconnects (Starlette cancels the send loop, possibly while the body
    generator is parked at a `yield`), or when the response never started. Closing the
    generator and finishing the ActiveRequest aborts whatever is unfinished at once,
    which frees its KV blocks in the core, rather than whenever the garbage collector
    gets to the generator.
    """

    def __init__(self, content: AsyncIterator[str], active: ActiveRequest,
                 media_type: str = "text/event-stream"):
        super().__init__(content, media_type=media_type)
        self.active = active

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]
            await self.active.finish()


async def run_until_disconnect(raw_request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its requests) if the client goes away."""
    handler = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not handler.done():
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)  # let its aborts run
    if handler.cancelled():
        raise ClientDisconnected()
    return handler.result()
