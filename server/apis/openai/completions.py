"""POST /v1/completions: prompts (text or token ids, single or batched) in, text out.

Choice indices: prompt p's i-th sample is choice `p * n + i`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import Request

from engine.request_output import CompletionOutput, RequestOutput, SampleLogprob
from engine.sampling_params import SamplingParams
from server.apis.openai.streaming import StreamChunkWriter, sse_body, usage_chunk_for
from server.chat.sampling import (
    build_sampling_params,
    check_common,
    check_prompts,
    json_logprob,
    make_usage,
    new_request_id,
    record_usage,
    record_user,
)
from server.chat.structured_outputs import structured_outputs_of
from server.common.errors import bad_request
from server.common.lifecycle import ActiveRequest
from server.common.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
)
from server.common.state import ServerState
from server.common.streaming import (
    EngineStreamingResponse,
    collect_finals,
    json_string,
    merge_streams,
)


def _prompts(state: ServerState, prompt) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) for each prompt of the request."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty.", "prompt", "invalid_value")
    limit = state.limits.max_prompts_per_request
    if len(prompt) > limit:
        raise bad_request(f"A request may hold at most {limit} prompts on this server "
                          f"(--max-prompts-per-request), got {len(prompt)}.", "prompt",
                          "invalid_value")
    tokenizer = state.tokenizer
    result = []
    for item in prompt:
        if isinstance(item, str):
            result.append((item, list(tokenizer(item).input_ids)))
        else:
            result.append((None, list(item)))
    return result


class _LogprobFormatter:
    """Builds OpenAI completion logprobs; tracks each choice's running text offset."""

    def __init__(self, state: ServerState, num_top: int):
        self.state = state
        self.num_top = num_top

    def format(self, logprobs: Sequence[SampleLogprob | None], token_ids: Sequence[int],
               offset: int) -> tuple[CompletionLogProbs, int]:
        result = CompletionLogProbs()
        token_text = self.state.engine.token_text
        for token_id, entry in zip(token_ids, logprobs, strict=False):
            token = entry.token if entry is not None else token_text(token_id)
            result.text_offset.append(offset)
            result.tokens.append(token)
            offset += len(token)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(json_logprob(entry.logprob))
            top = {t.token: json_logprob(t.logprob) for t in entry.top[:self.num_top]}
            top.setdefault(entry.token, json_logprob(entry.logprob))
            result.top_logprobs.append(top)
        return result, offset


async def prepare_completion(state: ServerState, body: CompletionRequest, raw_request: Request
                             ) -> tuple[list[tuple[str | None, list[int]]], SamplingParams]:
    """Check `body`: its prompts ((text or None, token ids) each) and SamplingParams, what
    `create_completion` queues and /v1/completions/render answers. Errors: 400 APIErrors."""
    check_common(state, body, body.unsupported_field())
    record_user(raw_request, body)
    prompts = _prompts(state, body.prompt)
    structured_outputs = await structured_outputs_of(body, state.engine)
    params = build_sampling_params(
        state, body, logprobs=body.logprobs,
        prompt_logprobs=body.logprobs if (body.echo and body.logprobs is not None) else None,
        structured_outputs=structured_outputs)
    check_prompts(state, [ids for _, ids in prompts], params, body)
    return prompts, params


async def create_completion(state: ServerState, body: CompletionRequest, raw_request: Request):
    prompts, params = await prepare_completion(state, body, raw_request)
    state.metrics.record_structured_output(params.structured_outputs, len(prompts))
    want_logprobs = body.logprobs is not None

    request_id = new_request_id("cmpl")
    created = int(time.time())
    formatter = _LogprobFormatter(state, body.logprobs or 0) if want_logprobs else None
    echo_texts = [
        (text if text is not None else state.tokenizer.decode(ids)) if body.echo else ""
        for text, ids in prompts
    ]
    # From here on the engine has the request: it ends with the response (see below).
    active = await state.lifecycle.start(
        [(f"{request_id}-{p}", ids, text) for p, (text, ids) in enumerate(prompts)], params,
        priority=body.priority, cache_salt=body.cache_salt,
        lora_request=state.lora_request(body.model))
    if body.stream:
        finals: list[RequestOutput | None] = [None] * len(prompts)
        chunks = _chunks(state, body, request_id, created, prompts, active, formatter,
                         echo_texts, finals)
        usage_chunk = usage_chunk_for(body, CompletionStreamResponse, state, request_id, created)
        return EngineStreamingResponse(
            sse_body(state, raw_request, active, chunks, finals, usage_chunk), active)

    finals = await collect_finals(raw_request, active)
    choices = []
    for p, final in enumerate(finals):
        for output in final.outputs:
            text, logprobs = output.text, None
            if formatter is not None:
                logprobs = _choice_logprobs(formatter, final, output, body.echo, echo_texts[p])
            choices.append(CompletionChoice(
                index=p * body.n + output.index,
                text=echo_texts[p] + text,
                logprobs=logprobs,
                finish_reason=output.finish_reason,
                stop_reason=output.stop_reason,
            ))
    usage = make_usage(finals)
    record_usage(raw_request, usage)
    return CompletionResponse(id=request_id, created=created, model=state.response_model(body.model),
                              choices=choices, usage=usage)


def _choice_logprobs(formatter: _LogprobFormatter, final: RequestOutput,
                     output: CompletionOutput, echo: bool, echo_text: str) -> CompletionLogProbs:
    offset = 0
    merged = CompletionLogProbs()
    if echo:
        prompt_logprobs = final.prompt_logprobs or [None] * final.num_prompt_tokens
        merged, offset = formatter.format(prompt_logprobs, final.prompt_token_ids, 0)
        offset = len(echo_text)
    part, _ = formatter.format(output.logprobs or [], output.token_ids, offset)
    merged.text_offset += part.text_offset
    merged.tokens += part.tokens
    merged.token_logprobs += part.token_logprobs
    merged.top_logprobs += part.top_logprobs
    return merged


class CompletionChunkWriter(StreamChunkWriter):
    """The SSE events of one streamed completion (see StreamChunkWriter)."""

    object_name = "text_completion"
    response_type = CompletionStreamResponse

    def text(self, index: int, text: str) -> str:
        """data: {... one choice: `index`, `text`, no logprobs, unfinished ...}"""
        return self._templated(index, f'"text":{json_string(text)}')

    def choice(self, choice: CompletionStreamChoice) -> str:
        return self._response([choice])


async def _chunks(
    state: ServerState,
    body: CompletionRequest,
    request_id: str,
    created: int,
    prompts: list[tuple[str | None, list[int]]],
    active: ActiveRequest,
    formatter: _LogprobFormatter | None,
    echo_texts: list[str],
    finals: list[RequestOutput | None],
) -> AsyncIterator[str]:
    """The completion chunks of a stream; `sse_body` adds usage, errors and [DONE]."""
    n = body.n
    num_choices = len(prompts) * n
    finish_sent = [False] * num_choices
    echo_pending = [body.echo] * num_choices
    offsets = [0] * num_choices

    writer = CompletionChunkWriter(request_id, created, state.response_model(body.model))

    async with contextlib.aclosing(merge_streams(active.streams)) as merged:
        async for p, request_output in merged:
            finals[p] = request_output
            for output in request_output.outputs:
                index = p * n + output.index
                if finish_sent[index]:
                    continue
                text = output.delta_text
                logprobs = None
                if formatter is not None:
                    logprobs = CompletionLogProbs()
                if echo_pending[index]:
                    echo_pending[index] = False
                    text = echo_texts[p] + text
                    if formatter is not None:
                        prompt_logprobs = (request_output.prompt_logprobs
                                           or [None] * request_output.num_prompt_tokens)
                        logprobs, _ = formatter.format(
                            prompt_logprobs, request_output.prompt_token_ids, 0)
                        offsets[index] = len(echo_texts[p])
                if formatter is not None and output.delta_logprobs:
                    part, offsets[index] = formatter.format(
                        output.delta_logprobs, output.delta_token_ids, offsets[index])
                    logprobs.text_offset += part.text_offset
                    logprobs.tokens += part.tokens
                    logprobs.token_logprobs += part.token_logprobs
                    logprobs.top_logprobs += part.top_logprobs
                finished = output.finished
                if not text and not finished and not (logprobs and logprobs.tokens):
                    continue
                finish_sent[index] = finished
                if logprobs is None and not finished:
                    yield writer.text(index, text)
                    continue
                yield writer.choice(CompletionStreamChoice(
                    index=index, text=text, logprobs=logprobs,
                    finish_reason=output.finish_reason if finished else None,
                    stop_reason=output.stop_reason if finished else None,
                ))
