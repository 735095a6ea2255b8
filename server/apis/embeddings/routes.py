"""The embedding routes: OpenAI's POST /v1/embeddings, Ollama's POST /api/embed and the
older POST /api/embeddings, over the shared path of server/apis/embeddings/run.py; and
scores of text pairs (vLLM's /score, Jina's and Cohere's /v1/rerank and /v2/rerank): a
cross-encoder's score of the pair, or with an embedding model the cosine similarity of
the two texts' embeddings, as vLLM scores.

    curl localhost:8000/v1/embeddings -H 'Content-Type: application/json' \\
      -d '{"model": "all-MiniLM-L6-v2", "input": ["a cat", "two dogs"]}'
"""

from __future__ import annotations

import base64
import dataclasses
import time

import numpy as np
from fastapi import APIRouter, FastAPI

from server.apis.embeddings.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    OllamaEmbeddingsRequest,
    OllamaEmbeddingsResponse,
    OllamaEmbedRequest,
    OllamaEmbedResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from server.apis.embeddings.run import (
    check_num_inputs,
    check_serves_embeddings,
    embed,
    pooling_params_for,
    prompted_inputs,
    tokenize_inputs,
)
from server.apis.ollama.protocol import OllamaError
from server.apis.ollama.routes import AnyContentTypeRoute
from server.apis.ollama.translator import served_name
from server.chat.sampling import check_model, new_request_id
from server.common.errors import ERROR_RESPONSES, bad_request, error_docs
from server.common.state import ServerState


def base64_vector(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the float32 values, little-endian, as base64."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def _truncation(state: ServerState, value: int | None, param: str) -> int | None:
    """vLLM's truncate_prompt_tokens: None (a 400 past the context), N, or -1 (the context)."""
    if value is not None and (value < -1 or value == 0):
        raise bad_request(f"{param} must be -1 or at least 1.", param, "invalid_value")
    return state.max_model_len if value == -1 else value


async def _scores(state: ServerState, queries: list[str], documents: list[str],
                  truncate: int | None, id_prefix: str) -> tuple[list[float], int]:
    """The score of each (queries[i], documents[i]) and the tokens computed: a
    cross-encoder's on the pair, else the cosine of the two embeddings."""
    if state.cross_encoder:
        return await _pair_scores(state, queries, documents, truncate, id_prefix)
    return await _cosines(state, queries, documents, truncate, id_prefix)


def _pair_prompt(state: ServerState, query: str, document: str, truncate: int | None
                 ) -> tuple[list[int], int | None]:
    """A pair's token ids as the cross-encoder reads them, and where its token type 1
    starts (None: one type). An encoder's: the tokenizer's pair template (BERT's [CLS] q
    [SEP] d [SEP], the document's tokens type 1; XLM-RoBERTa's <s> q </s></s> d </s>, no
    types), as sentence-transformers' CrossEncoder tokenizes it, truncation cutting the
    document. A decoder reranker's: the one text query + document, as vLLM reads it,
    truncation cutting its end."""
    limit = min(truncate or state.max_model_len, state.max_model_len)
    if state.pairs_as_one_text:
        cut = {"truncation": True, "max_length": limit} if truncate else {}
        return list(state.tokenizer(query + document, **cut).input_ids), None
    encoded = state.tokenizer(query, document, truncation="only_second" if truncate else False,
                              max_length=limit if truncate else None)
    types = encoded.get("token_type_ids")
    return list(encoded.input_ids), (types.index(1) if types and 1 in types else None)


async def _pair_scores(state: ServerState, queries: list[str], documents: list[str],
                       truncate: int | None, id_prefix: str) -> tuple[list[float], int]:
    """A cross-encoder's score of each pair, read together (_pair_prompt): the sigmoid
    of a one-label head's logit (a several-label head: the softmax probability of its
    last label), as sentence-transformers' CrossEncoder scores."""
    check_num_inputs(len(documents), "documents")
    token_lists, params = [], []
    for index, (query, document) in enumerate(zip(queries, documents, strict=True)):
        if not query or not document:
            raise bad_request(f"Pair {index} has an empty text.", "documents", "invalid_value")
        ids, type_start = _pair_prompt(state, query, document, truncate)
        if len(ids) > state.max_model_len:
            raise bad_request(f"Pair {index} has {len(ids)} tokens; this model's maximum "
                              f"context length is {state.max_model_len} tokens.", "documents",
                              "context_length_exceeded")
        token_lists.append(ids)
        params.append(dataclasses.replace(state.pooling, token_type_start=type_start))
    result = await embed(state, token_lists, params, id_prefix)
    scores = []
    for logits in result.vectors:
        values = np.asarray(logits, dtype=np.float64)
        if len(values) == 1:
            scores.append(float(1 / (1 + np.exp(-values[0]))))
        else:
            exp = np.exp(values - values.max())
            scores.append(float(exp[-1] / exp.sum()))
    return scores, result.num_prompt_tokens


async def _cosines(state: ServerState, queries: list[str], documents: list[str],
                   truncate: int | None, id_prefix: str) -> tuple[list[float], int]:
    """cos(embed(queries[i]), embed(documents[i])) for each i, every distinct text
    embedded once, in one admission; and the tokens embedded."""
    texts = list(dict.fromkeys([*queries, *documents]))
    token_lists = tokenize_inputs(state, texts, truncate)
    params = dataclasses.replace(state.pooling, normalize=True, dimensions=None)
    result = await embed(state, token_lists, params, id_prefix)
    vector_of = {text: np.asarray(v) for text, v in zip(texts, result.vectors, strict=True)}
    scores = [float(vector_of[q] @ vector_of[d]) for q, d in zip(queries, documents, strict=True)]
    return scores, result.num_prompt_tokens


def install_routes(app: FastAPI, state: ServerState, auth: list) -> None:
    @app.post("/v1/embeddings", response_model=EmbeddingResponse, dependencies=auth,
              responses=ERROR_RESPONSES)
    async def embeddings(body: EmbeddingRequest) -> EmbeddingResponse:
        """One vector per input (the model's pooling: modules.json, or --runner pooling)."""
        check_model(state, body.model)
        check_serves_embeddings(state)
        params = pooling_params_for(state, body.dimensions)
        truncate = _truncation(state, body.truncate_prompt_tokens, "truncate_prompt_tokens")
        token_lists, params = prompted_inputs(state, body.input, truncate, params,
                                              body.prompt_name)
        result = await embed(state, token_lists, params, "embd")
        encode = base64_vector if body.encoding_format == "base64" else (lambda v: v)
        return EmbeddingResponse(
            data=[EmbeddingData(index=i, embedding=encode(vector))
                  for i, vector in enumerate(result.vectors)],
            model=state.model_name,
            usage=EmbeddingUsage(prompt_tokens=result.num_prompt_tokens,
                                 total_tokens=result.num_prompt_tokens))

    async def score(body: ScoreRequest) -> ScoreResponse:
        """vLLM's: the score of `text_1` against each of `text_2` (cosine of embeddings)."""
        check_model(state, body.model)
        check_serves_embeddings(state, scores=True)
        first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second) or not second:
            raise bad_request("text_1 must be one text, or as many texts as text_2 (got "
                              f"{len(first)} and {len(second)}).", "text_1", "invalid_value")
        truncate = _truncation(state, body.truncate_prompt_tokens, "truncate_prompt_tokens")
        scores, num_tokens = await _scores(state, first, second, truncate, "score")
        return ScoreResponse(
            id=new_request_id("score"), created=int(time.time()), model=state.model_name,
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))

    async def rerank(body: RerankRequest) -> RerankResponse:
        """Jina's / Cohere's: the documents by relevance to the query, best first."""
        check_model(state, body.model)
        check_serves_embeddings(state, scores=True)
        if body.top_n is not None and body.top_n < 1:
            raise bad_request("top_n must be at least 1.", "top_n", "invalid_value")
        texts = [d if isinstance(d, str) else d.text for d in body.documents]
        if body.max_tokens_per_doc is not None and body.truncate_prompt_tokens is None:
            truncate = _truncation(state, body.max_tokens_per_doc, "max_tokens_per_doc")
        else:
            truncate = _truncation(state, body.truncate_prompt_tokens, "truncate_prompt_tokens")
        scores, num_tokens = await _scores(state, [body.query] * len(texts), texts, truncate,
                                           "rerank")
        order = sorted(range(len(texts)), key=lambda i: -scores[i])[:body.top_n]
        return RerankResponse(
            id=new_request_id("rerank"), model=state.model_name,
            usage=RerankUsage(total_tokens=num_tokens),
            results=[RerankResult(index=i, relevance_score=scores[i],
                                  document=RerankDocument(text=texts[i])
                                  if body.return_documents else None) for i in order])

    for path in ("/score", "/v1/score"):
        app.post(path, response_model=ScoreResponse, dependencies=auth,
                 responses=ERROR_RESPONSES)(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path, response_model=RerankResponse, dependencies=auth,
                 response_model_exclude_none=True, responses=ERROR_RESPONSES)(rerank)

    router = APIRouter(route_class=AnyContentTypeRoute)
    errors = error_docs(OllamaError)

    @router.post("/api/embed", response_model=OllamaEmbedResponse, dependencies=auth,
                 responses=errors)
    async def api_embed(body: OllamaEmbedRequest) -> OllamaEmbedResponse:
        """Ollama's: one vector per input; `truncate` (default true) cuts inputs to fit."""
        start = time.perf_counter_ns()
        served_name(state, body.model)
        check_serves_embeddings(state)
        params = pooling_params_for(state, body.dimensions)
        token_lists, params = prompted_inputs(
            state, body.input, state.max_model_len if body.truncate else None, params)
        result = await embed(state, token_lists, params, "ollama-embed")
        return OllamaEmbedResponse(model=body.model, embeddings=result.vectors,
                                   total_duration=time.perf_counter_ns() - start,
                                   prompt_eval_count=result.num_prompt_tokens)

    @router.post("/api/embeddings", response_model=OllamaEmbeddingsResponse,
                 dependencies=auth, responses=errors)
    async def api_embeddings(body: OllamaEmbeddingsRequest) -> OllamaEmbeddingsResponse:
        """Ollama's older endpoint: one prompt, one vector (cut to fit the context)."""
        served_name(state, body.model)
        check_serves_embeddings(state)
        token_lists, params = prompted_inputs(state, body.prompt, state.max_model_len,
                                              state.pooling, param="prompt")
        result = await embed(state, token_lists, params, "ollama-embeddings")
        return OllamaEmbeddingsResponse(embedding=result.vectors[0])

    app.include_router(router)
