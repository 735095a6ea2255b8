"""What the HTTP handlers share: the engine, the tokenizer, and the served model's facts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.frontend.async_engine import HEALTH_PING_TIMEOUT_S, HEALTH_STEP_TIMEOUT_S, AsyncEngine
from engine.lora_request import LoRARequest
from engine.model_loader.pooling_config import EmbeddingPrompts
from engine.multimodal.processor import ImagePromptProcessor
from engine.pooling_params import PoolingParams
from engine.sampling_defaults import SamplingDefaults
from engine.xray_schema import XrayLimits
from server.common.lifecycle import Lifecycle, ServerLimits
from server.common.lora import LoRAAdapters
from server.common.metrics import ServerMetrics


@dataclass(frozen=True)
class XrayOptions:
    """GET /xray and /xray/state (server/http/xray.py): --no-xray, --xray-show-text."""

    enabled: bool = True  # --no-xray: no routes at all
    show_text: bool = False  # --xray-show-text: prompt and output text of listed requests
    min_interval_s: float = 0.25  # at most 4 snapshots a second
    max_interval_s: float = 30.0  # the stalest a costly snapshot (a huge pool) may get
    max_core_share: float = 0.01  # of the core's time spent building snapshots
    timeout_s: float = 10.0  # waiting for the core (it answers between two steps)
    max_text_chars: int = 200  # per prompt and per output, with --xray-show-text
    limits: XrayLimits = field(default_factory=XrayLimits)


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any
    served_model_names: list[str]
    model_root: str  # the local model directory
    metrics: ServerMetrics
    api_key: str | None = None
    max_running_requests: int = 0  # --max-num-seqs (the load report's)
    scheduling_policy: str = "fcfs"  # "priority": requests' `priority` field orders them
    # Extra end-of-sequence ids (e.g. from generation_config) added to every request.
    extra_stop_token_ids: list[int] = field(default_factory=list)
    # What a request's unset sampling fields take (--generation-config,
    # --override-generation-config, --max-tokens-default; engine/sampling_defaults.py).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # Where the chat template came from, and how message content reaches it ("string":
    # the text; "openai": a list of text parts). engine/model_loader/chat_templates.py.
    chat_template_source: str = "the model's"
    chat_content_format: str = "string"
    created: int = field(default_factory=lambda: int(time.time()))
    limits: ServerLimits = field(default_factory=ServerLimits)
    # Admission, deadlines and the shutdown drain (built from `limits` if not given).
    lifecycle: Lifecycle | None = None
    # /health: how long the engine core may take to answer a ping, and how long a busy
    # core that does not answer still counts as alive (see AsyncEngine.check_health).
    health_ping_timeout_s: float = HEALTH_PING_TIMEOUT_S
    health_step_timeout_s: float = HEALTH_STEP_TIMEOUT_S
    # GET /xray and /xray/state (--no-xray, --xray-show-text).
    xray: XrayOptions = field(default_factory=XrayOptions)
    # Chat: the parser of tool_choice "auto" (None: "auto" is refused) and of reasoning.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # What the model serves (--runner; engine/model_loader/pooling_config.py): "generate"
    # (text) or "pooling" (embeddings), and how it pools: its vector size, and whether it
    # declares Matryoshka dimensions (`dimensions` below its size).
    runner: str = "generate"
    pooling: PoolingParams = field(default_factory=lambda: PoolingParams("last"))
    embedding_size: int | None = None
    matryoshka: bool = False
    cross_encoder: bool = False  # a reranker scoring (query, document) pairs
    # sentence-transformers' named prompts, put before text inputs (`prompt_name`).
    embedding_prompts: EmbeddingPrompts = field(default_factory=lambda: EmbeddingPrompts({}))
    # A decoder reranker's pair is one text, query + document (vLLM's); else the
    # tokenizer's pair template (server/apis/embeddings/routes.py).
    pairs_as_one_text: bool = False
    # --enable-lora: the adapters offered under their own names (server/common/lora.py);
    # None: the base only. `lora_runtime_updating`: /v1/load_lora_adapter and unload.
    lora: LoRAAdapters | None = None
    lora_runtime_updating: bool = False
    # A vision-language model's prompt processor (engine/multimodal/processor.py); None: the
    # model takes no images.
    image_processor: ImagePromptProcessor | None = None

    # The Responses API's stored responses (server/apis/responses/store.py; its routes
    # build it from `limits` if not given).
    responses: Any = None

    def __post_init__(self) -> None:
        if self.lifecycle is None:
            self.lifecycle = Lifecycle(self.engine, self.limits, self.metrics)

    @property
    def model_name(self) -> str:
        """The base model's name: what responses of base requests carry."""
        return self.served_model_names[0]

    def response_model(self, model: str | None) -> str:
        """The name a response to a request for `model` carries: the adapter's own name
        for a LoRA adapter (as vLLM answers), else the base's first served name."""
        return model if self.lora_request(model) is not None else self.model_name

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base)."""
        return None if self.lora is None else self.lora.get(model)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len
