"""Request and response models of the embedding endpoints: OpenAI's /v1/embeddings and
Ollama's /api/embed and /api/embeddings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from server.apis.ollama.protocol import OllamaRequest
from server.common.protocol import Int64, OpenAIRequest, OpenAIResponse

# One request's inputs at most (each is one engine request): a 400 past it.
MAX_INPUTS_PER_REQUEST = 2048


# ------------------------------------------------------------------------ OpenAI
class EmbeddingRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[str] | list[Int64] | list[list[Int64]] = Field(
        ..., description="A text, a list of texts, token ids, or a list of token-id lists "
        f"(at most {MAX_INPUTS_PER_REQUEST} inputs).")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector's float32 values, little-endian, base64.")
    dimensions: Int64 | None = Field(
        None, description="Keep the first N values (Matryoshka models only).")
    user: str | None = None
    truncate_prompt_tokens: Int64 | None = Field(
        None, description="vLLM's: cut each input to its first N tokens (-1: to the "
        "model's context) instead of a 400 when it is longer.")
    prompt_name: str | None = Field(
        None, description="TEI's: one of the model's sentence-transformers prompts "
        "(config_sentence_transformers.json, e.g. e5's \"query\"), put before each text "
        "input. Default: the model's default_prompt_name, if it has one.")


class EmbeddingData(OpenAIResponse):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(OpenAIResponse):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIResponse):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


# ------------------------------------------------------------------------ Ollama
class OllamaEmbedRequest(OllamaRequest):
    model: str
    input: str | list[str] = Field(..., description="A text or a list of texts.")
    truncate: bool = Field(True, description="Cut each input to the context (else a 400).")
    dimensions: Int64 | None = None
    keep_alive: str | int | None = None
    options: dict | None = None


class OllamaEmbedResponse(OllamaRequest):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int = 0
    prompt_eval_count: int


class OllamaEmbeddingsRequest(OllamaRequest):
    """The older /api/embeddings: one prompt."""

    model: str
    prompt: str
    keep_alive: str | int | None = None
    options: dict | None = None


class OllamaEmbeddingsResponse(OllamaRequest):
    embedding: list[float]


# --------------------------------------------------------- scores and reranking
class ScoreRequest(OpenAIRequest):
    """vLLM's /score: `text_1` against each of `text_2` (one text against a list, or two
    lists pair by pair)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Int64 | None = None


class ScoreData(OpenAIResponse):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIResponse):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankDocument(OpenAIRequest):
    text: str


class RerankRequest(OpenAIRequest):
    """Jina's and Cohere's rerank (/v1/rerank, /v2/rerank)."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument] = Field(..., min_length=1)
    top_n: Int64 | None = Field(None, description="Return the best N (default: all).")
    return_documents: bool = True
    truncate_prompt_tokens: Int64 | None = None
    max_tokens_per_doc: Int64 | None = None  # Cohere v2's; as truncate_prompt_tokens


class RerankResult(OpenAIResponse):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(OpenAIResponse):
    total_tokens: int


class RerankResponse(OpenAIResponse):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
