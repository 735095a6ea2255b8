"""Prometheus metrics: the one place where engine statistics become metric values.

`ServerMetrics` is the AsyncEngine's observer; the HTTP layer reports the requests the
engine never saw. The whole contract:
  * `on_step(stats)`: once per engine-core step output (and once when the core goes
    idle), with that step's `SchedulerStats`: gauges, token/prefix/preemption counters,
    inter-token latencies, step duration and size;
  * `on_request_finished(output, error)`: once per finished request (any reason), with
    its cumulative `RequestOutput` (token counts, `RequestMetrics` timestamps): the
    request counters and the per-request latency/length histograms;
  * `record_request_failure(reason)` / `record_error(exc, path)`: a request that failed
    before the engine had it (bad request, overload, client gone, dead engine);
  * `set_cache_config(cache_config, kv_cache_info)`: once at start-up (info metric).

Every request is counted exactly once in `request_success_total` or
`request_failure_total`: one that reached the engine by `on_request_finished`
(stop/length/abort -> success{finished_reason}; an engine error ->
failure{reason="engine_error"}), one that did not by `record_request_failure`. So the
HTTP layer must NOT report a request the engine already has: a client that disconnects
mid-generation ends as finished_reason="abort" (as in vLLM); failure{reason="aborted"}
is for a client that left before its request reached the engine (e.g. while it waited
for admission). A "request" is one prompt: a completions batch of 3 prompts is 3, and
`n` samples of one prompt are 1; only a rejected request body (4xx, counted as
"validation") is one, whatever it held.

Token counters come from the engine's step stats, so they move while requests run:
  * prompt_tokens_total: a request's whole prompt (prefix-cache hits included) once, in
    the step of its first token - the `usage.prompt_tokens` a client sees (for n > 1 each
    sequence counts the prompt; usage counts it once);
  * generation_tokens_total: tokens sampled - `usage.completion_tokens`, except tokens
    the core sampled after a stop string matched (the frontend drops them; they were
    computed all the same) and, for an aborted request, tokens no client received.

Exposition: the classic text format (0.0.4) whatever the scraper asks for. Names keep
their colons there; prometheus-client's OpenMetrics writer would escape them to '_',
which would break every dashboard and alert query. Each server owns its own registry,
so several servers can live in one process (tests).

Several API server processes (`serve --api-server-count N`, `multiprocess=True`):
prometheus-client's multiprocess mode. Every process writes its values to files in
the launcher's PROMETHEUS_MULTIPROC_DIR, and /metrics on any of them renders the sum
over all of them (counters, histograms), so every frontend reports the whole server.
The engine core sends its per-step SchedulerStats to API server 0 only
(engine/core/shared_core.py, STATS_FRONTEND), so the step metrics are counted once; their gauges
take the most recently set value of any process ("mostrecent"). Per process: only
`cache_config_info` (an Info, which multiprocess mode lacks; every process sets the
same labels, so each exposes the same series).
"""

from __future__ import annotations

import re

import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

from engine.config import CacheConfig
from engine.frontend.async_engine import EngineRequestError
from engine.frontend.core_client import EngineDeadError
from engine.frontend.processor import PromptError
from engine.outputs import SchedulerStats
from engine.request_output import RequestOutput
from engine.sampling_params import SamplingParamsError
from engine.structured_output import GRAMMAR_KINDS, StructuredOutputsParams
from server.common.api_label import GENERATION_APIS, GENERATION_PATHS

# No `<name>_created` companion series: they are not part of the catalogue, and they
# would double the number of series Prometheus stores. (Process-wide, as vLLM does.)
prometheus_client.disable_created_metrics()

PREFIX = "pagedserve:"
FINISHED_REASONS = ("stop", "length", "abort")
FAILURE_REASONS = ("validation", "overload", "aborted", "engine_error")
# Routes whose error answers count as failed requests (not /tokenize, not 404 routes).
COUNTED_PATHS = GENERATION_PATHS

# Buckets cover a GPU deployment (milliseconds) and a CPU one (seconds per token, minutes
# per request) alike: a 1-2.5-5 series per decade.
#   request latencies (TTFT, e2e, queue, prefill, decode): 1 ms .. 1000 s
REQUEST_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0,
    100.0, 250.0, 500.0, 1000.0,
)
#   per-token and per-step times (ITL, TPOT, step duration): 1 ms .. 20 s, finer where
#   GPU decode steps (10-100 ms) and CPU ones (0.1-2 s) fall
TOKEN_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
)
#   token counts (prompt/generation lengths, tokens per step): powers of two, 1 .. 128Ki
TOKEN_COUNT_BUCKETS = tuple(float(1 << i) for i in range(18))

_FAILURE_EXEMPT_STATUS = frozenset({408, 429})  # timeouts/overload: the admission layer's


def failure_reason(exc: BaseException) -> str | None:
    """The request_failure_total reason of an error answered before the engine had the
    request, or None when it is not one (counted elsewhere, or not a request failure).

    4xx (bad request, unknown model, missing API key, body too large) -> "validation";
    a dead engine at admission (EngineDeadError, or the 503 "engine_dead" it becomes) ->
    "engine_error". A request the engine already had (EngineRequestError, also when the
    engine died under it) is counted by the engine itself, overload and shutdown answers
    (503/429) by the admission control, timeouts (504) as the engine's abort.
    """
    if isinstance(exc, EngineRequestError) or isinstance(exc.__cause__, EngineRequestError):
        return None  # the request was in the engine, which counted it (dead engine or not)
    if isinstance(exc, EngineDeadError):
        return "engine_error"
    if isinstance(exc, (PromptError, SamplingParamsError)):
        return "validation"
    status = getattr(exc, "status_code", None)
    if not isinstance(status, int):
        return None
    if status == 503 and getattr(exc, "code", None) == "engine_dead":
        return "engine_error"
    if 400 <= status < 500 and status not in _FAILURE_EXEMPT_STATUS:
        return "validation"
    return None


class ServerMetrics:
    def __init__(self, model_name: str, multiprocess: bool = False, names: str = "both",
                 max_loras: int = 0):
        """`multiprocess`: one of several API server processes (see the module doc);
        needs PROMETHEUS_MULTIPROC_DIR in the environment before prometheus_client
        is imported. `names`: "pagedserve", "vllm" or "both" (--metrics-names).
        `max_loras`: --max-loras with --enable-lora, else 0 (lora_requests_info)."""
        self.model_name = model_name
        self.names = names
        self.max_loras = max_loras
        # The last step's KV-cache usage and the prefix cache's tokens (looked up, found)
        # since start-up, for the load report (server/http/loads.py).
        self.kv_cache_usage_now = 0.0
        self.prefix_cache_tokens = (0, 0)
        self.registry = CollectorRegistry()  # what /metrics renders
        labels = ["model_name"]
        # The registry the metrics join: with several processes their values live in
        # the shared files, and /metrics renders those (MultiProcessCollector) instead.
        r: CollectorRegistry | None = self.registry
        gauge_kwargs: dict = {}
        if multiprocess:
            MultiProcessCollector(self.registry)
            r = None
            gauge_kwargs = {"multiprocess_mode": "mostrecent"}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r,
                         **gauge_kwargs).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            # prometheus-client drops a trailing "_total" from the name and adds it back
            # to the sample: "pagedserve:prompt_tokens_total" is exposed as written.
            return Counter(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=r).labels(model_name)

        # ------------------------------------------------------------ per step
        self.num_requests_running = gauge(
            "num_requests_running", "Requests in the engine's running queue.")
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Requests waiting for a KV-cache seat (preempted included).")
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc",
            "Fraction of KV-cache blocks held by requests (0-1; free prefix-cached blocks "
            "count as free).")
        self.prompt_tokens = counter(
            "prompt_tokens_total",
            "Prompt tokens of requests whose prefill finished (prefix-cache hits included).")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter(
            "prefix_cache_hits_total", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter(
            "num_preemptions_total", "Requests preempted (KV blocks taken back, recomputed).")
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between two tokens of a sequence.",
            TOKEN_LATENCY_BUCKETS_S)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens computed per engine step (prefill and decode).",
            TOKEN_COUNT_BUCKETS)
        self.cpu_turns_wait = counter(
            "cpu_turns_wait_seconds_total", "Seconds the engine waited for its turn on the "
            "CPUs (--cpu-turns).")
        self.step_duration = histogram(
            "step_duration_seconds", "Duration of an engine step (schedule, model, update).",
            TOKEN_LATENCY_BUCKETS_S)

        # ------------------------------------------------------------ per request
        self._request_success = Counter(
            PREFIX + "request_success_total",
            "Requests the engine finished, by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"], registry=r)
        self._request_failure = Counter(
            PREFIX + "request_failure_total",
            "Requests that failed, by reason (validation, overload, aborted, engine_error).",
            ["model_name", "reason"], registry=r)
        # Every documented label value exists from the start (at 0), so rate() and
        # ratios work before the first failure of a kind.
        self.request_success = {
            reason: self._request_success.labels(model_name, reason)
            for reason in FINISHED_REASONS
        }
        self.request_failure = {
            reason: self._request_failure.labels(model_name, reason)
            for reason in FAILURE_REASONS
        }
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", REQUEST_LATENCY_BUCKETS_S)
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Decode time / (output tokens - 1) of a finished request.", TOKEN_LATENCY_BUCKETS_S)
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish of a finished request.",
            REQUEST_LATENCY_BUCKETS_S)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.",
            REQUEST_LATENCY_BUCKETS_S)
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.",
            REQUEST_LATENCY_BUCKETS_S)
        self.decode_time = histogram(
            "request_decode_time_seconds", "First token to last token of a finished request.",
            REQUEST_LATENCY_BUCKETS_S)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of a finished request.", TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens generated for a finished request.",
            TOKEN_COUNT_BUCKETS)
        # ------------------------------------------------------------ structured outputs
        self._structured_requests = Counter(
            PREFIX + "structured_output_requests_total",
            "Requests whose output a grammar constrains, by kind (json, json_object, regex, "
            "choice, grammar; tool_choice required/named count as json).",
            ["model_name", "kind"], registry=r)
        self.structured_requests = {
            kind: self._structured_requests.labels(model_name, kind) for kind in GRAMMAR_KINDS
        }
        self.grammar_compile_time = histogram(
            "grammar_compile_seconds",
            "Time to compile one grammar in the engine (cache hits are not compiles).",
            TOKEN_LATENCY_BUCKETS_S)
        # ------------------------------------------------------------ images
        self.mm_images = counter(
            "mm_images_total", "Images received in requests (vision models).")
        self.mm_images_encoded = counter(
            "mm_images_encoded_total", "Images run through the vision encoder.")
        self.mm_encoder_cache_hits = counter(
            "mm_encoder_cache_hits_total", "Images a request read from the encoder cache "
            "instead of encoding them (another request, or an earlier one, had).")
        self.mm_encoder_seconds = counter(
            "mm_encoder_seconds_total", "Seconds the vision encoder ran.")
        # ------------------------------------------------------------ embeddings
        self.embedding_inputs = counter(
            "embedding_inputs_total", "Inputs embedded (each is one pooling request).")
        self.embedding_tokens = counter(
            "embedding_tokens_total", "Tokens of the embedded inputs.")
        self.embedding_request_time = histogram(
            "embedding_request_seconds", "Time from an embedding request's admission to its "
            "vectors (all of its inputs).", TOKEN_LATENCY_BUCKETS_S)
        # ------------------------------------------------------------ LoRA adapters
        # vLLM's info gauge: the adapters with requests running / waiting now as
        # comma-separated label values, the value the time of the last step (routers
        # such as llm-d's endpoint picker read the newest series). One series at a time
        # here; with several API server processes an earlier one can linger, so the
        # newest value is the one to read.
        self._lora_info = Gauge(
            PREFIX + "lora_requests_info",
            "LoRA adapters of the running and waiting requests (labels); the value is "
            "the time they were seen.",
            ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=r, **gauge_kwargs)
        self._lora_info_labels: tuple[str, ...] | None = None
        self._set_lora_info({}, {})
        self._lora_requests = Counter(
            PREFIX + "lora_adapter_requests_total",
            "Requests the engine finished under each LoRA adapter (any finish reason).",
            ["model_name", "lora_name"], registry=r)
        self._lora_generation_tokens = Counter(
            PREFIX + "lora_adapter_generation_tokens_total",
            "Tokens generated under each LoRA adapter (counted when its request finishes).",
            ["model_name", "lora_name"], registry=r)
        # ------------------------------------------------------------ per API
        self._api_requests = Counter(
            PREFIX + "api_requests_total",
            "HTTP requests to the inference routes, by API (openai_chat, openai_completions, "
            "openai_responses, anthropic_messages, ollama_chat, ollama_generate, "
            "openai_embeddings, ollama_embed, ollama_embeddings, vllm_score, rerank) and status "
            "class (2xx, 4xx, 5xx).", ["model_name", "api", "status"], registry=r)
        for api in GENERATION_APIS.values():
            self._api_requests.labels(model_name, api, "2xx")
        # ------------------------------------------------------------ speculative decoding
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts_total",
            "Drafts verified (a request carrying draft tokens in a step counts once).")
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens_total", "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens_total", "Draft tokens accepted.")
        self.spec_decode_num_grammar_cut_tokens = counter(
            "spec_decode_num_grammar_cut_tokens_total",
            "Proposed draft tokens cut before verification: the request's grammar refuses "
            "them (structured outputs).")
        self._spec_decode_accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos_total",
            "Draft tokens accepted, by their position in the draft (0 = first).",
            ["model_name", "position"], registry=r)
        self.spec_decode_accepted_per_pos = [
            self._spec_decode_accepted_per_pos.labels(model_name, "0")]
        self._cache_config = Info(  # per process, also with several (see the module doc)
            PREFIX + "cache_config", "KV-cache configuration (value 1; the facts are labels).",
            labels, registry=self.registry)

    # ---------------------------------------------------------------- start-up
    def set_cache_config(self, cache_config: CacheConfig, kv_cache_info) -> None:
        """Publish `pagedserve:cache_config_info` (kv_cache_info: engine.outputs.KVCacheInfo)."""

        def text(value) -> str:
            if value is None:
                return ""
            return str(value).lower() if isinstance(value, bool) else str(value)

        self._cache_config.labels(self.model_name).info({
            "block_size": text(kv_cache_info.block_size),
            "num_blocks": text(kv_cache_info.num_blocks),
            "num_tokens": text(kv_cache_info.num_blocks * kv_cache_info.block_size),
            "enable_prefix_caching": text(cache_config.enable_prefix_caching),
            "prefix_caching_hash_algo": text(cache_config.prefix_caching_hash_algo),
            "kv_cache_memory_bytes": text(cache_config.kv_cache_memory_bytes),
            "gpu_memory_utilization": text(cache_config.gpu_memory_utilization),
            "num_gpu_blocks_override": text(cache_config.num_gpu_blocks_override),
        })

    # ---------------------------------------------------------------- engine hooks
    def on_step(self, stats: SchedulerStats) -> None:
        self.kv_cache_usage_now = stats.kv_cache_usage
        queried, hit = self.prefix_cache_tokens
        self.prefix_cache_tokens = (queried + stats.prefix_cache_queries,
                                    hit + stats.prefix_cache_hits)
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prompt_tokens.inc(stats.num_prompt_tokens_prefilled)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.preemptions.inc(stats.num_preemptions)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        for seconds in stats.inter_token_latencies_s:
            self.inter_token_latency.observe(seconds)
        for seconds in stats.grammar_compile_seconds:
            self.grammar_compile_time.observe(seconds)
        if stats.spec_num_drafts:
            self._on_spec_decode(stats)
        if stats.spec_num_grammar_cut_tokens:  # a draft cut whole is not verified at all
            self.spec_decode_num_grammar_cut_tokens.inc(stats.spec_num_grammar_cut_tokens)
        if stats.mm_images_encoded or stats.mm_encoder_cache_hits:
            self.mm_images_encoded.inc(stats.mm_images_encoded)
            self.mm_encoder_cache_hits.inc(stats.mm_encoder_cache_hits)
            self.mm_encoder_seconds.inc(stats.mm_encoder_seconds)
        if stats.cpu_turns_wait_seconds:
            self.cpu_turns_wait.inc(stats.cpu_turns_wait_seconds)
        if stats.num_scheduled_tokens > 0:  # idle reports and failed steps computed nothing
            self.iteration_tokens.observe(stats.num_scheduled_tokens)
            self.step_duration.observe(stats.step_duration_s)
        if self.max_loras:
            self._set_lora_info(stats.running_lora_adapters, stats.waiting_lora_adapters)

    def _set_lora_info(self, running: dict[str, int], waiting: dict[str, int]) -> None:
        """lora_requests_info's one series: these adapters, stamped now. Example:
        running {"a": 2, "b": 1}, waiting {} -> {max_lora="2",running_lora_adapters="a,b",
        waiting_lora_adapters=""} 1733318400.0."""
        labels = (self.model_name, str(self.max_loras), ",".join(sorted(running)),
                  ",".join(sorted(waiting)))
        if self._lora_info_labels not in (None, labels):
            self._lora_info.remove(*self._lora_info_labels)
        self._lora_info_labels = labels
        self._lora_info.labels(*labels).set_to_current_time()

    def _on_spec_decode(self, stats: SchedulerStats) -> None:
        self.spec_decode_num_drafts.inc(stats.spec_num_drafts)
        self.spec_decode_num_draft_tokens.inc(stats.spec_num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(stats.spec_num_accepted_tokens)
        per_pos = self.spec_decode_accepted_per_pos
        for pos, count in enumerate(stats.spec_num_accepted_tokens_per_pos):
            while len(per_pos) <= pos:
                per_pos.append(self._spec_decode_accepted_per_pos.labels(
                    self.model_name, str(len(per_pos))))
            per_pos[pos].inc(count)

    def on_request_finished(self, output: RequestOutput, error: str | None) -> None:
        """Count the request; observe its latencies.

        TTFT, queue and prefill time are observed for every request that got that far
        (an aborted one too); e2e, decode time, TPOT and the lengths only for requests
        that finished by stop or length (an abort's numbers say when the client gave up).
        """
        m = output.metrics
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.first_token_time is not None:
            self.time_to_first_token.observe(max(0.0, m.first_token_time - m.arrival_time))
            if m.first_scheduled_time is not None:
                self.prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        if output.lora_name is not None:
            self._lora_requests.labels(self.model_name, output.lora_name).inc()
            self._lora_generation_tokens.labels(self.model_name, output.lora_name).inc(
                output.num_generation_tokens)
        if error is not None:
            self.request_failure["engine_error"].inc()
            return
        reason = finish_reason(output)
        self.request_success[reason].inc()
        if reason == "abort":
            return
        if m.finished_time is not None:
            self.e2e_latency.observe(max(0.0, m.finished_time - m.arrival_time))
        self.request_prompt_tokens.observe(output.num_prompt_tokens)
        self.request_generation_tokens.observe(output.num_generation_tokens)
        if m.first_token_time is not None and m.last_token_time is not None:
            decode_s = max(0.0, m.last_token_time - m.first_token_time)
            self.decode_time.observe(decode_s)
            longest = max((len(o.token_ids) for o in output.outputs), default=0)
            if longest > 1:
                self.time_per_output_token.observe(decode_s / (longest - 1))

    # ---------------------------------------------------------------- HTTP hooks
    def record_structured_output(self, params: StructuredOutputsParams | None,
                                 num_prompts: int = 1) -> None:
        """Count the prompts of a request the engine will constrain (None: free ones)."""
        if params is not None:
            self.structured_requests[params.kind].inc(num_prompts)

    def record_images(self, num_images: int) -> None:
        """Count the images of a request that reaches the engine."""
        self.mm_images.inc(num_images)

    def record_embeddings(self, num_inputs: int, num_tokens: int, seconds: float) -> None:
        """Count one answered embedding request: its inputs, their tokens, its time."""
        self.embedding_inputs.inc(num_inputs)
        self.embedding_tokens.inc(num_tokens)
        self.embedding_request_time.observe(seconds)

    def record_api_request(self, api: str, status: str) -> None:
        """Count one answered request of `api` (server/common/api_label.py) by status class."""
        self._api_requests.labels(self.model_name, api, status).inc()

    def record_request_failure(self, reason: str) -> None:
        """Count a request that failed before the engine had it (see the module doc).

        reason: "validation" (a 4xx answer), "overload" (rejected by admission control),
        "aborted" (the client left before the request reached the engine),
        "engine_error" (the engine was dead).
        """
        counter = self.request_failure.get(reason)
        if counter is None:
            raise ValueError(f"unknown failure reason {reason!r}; one of {FAILURE_REASONS}")
        counter.inc()

    def record_error(self, exc: BaseException, path: str | None = None) -> None:
        """Count an error answer (an APIError or engine exception) of an inference route.

        `path`: the request's URL path; errors of other routes are not request failures.
        Errors `failure_reason` does not classify are counted elsewhere or not at all.
        """
        if path is not None and path not in COUNTED_PATHS:
            return
        reason = failure_reason(exc)
        if reason is not None:
            self.record_request_failure(reason)

    # ---------------------------------------------------------------- export
    def render(self) -> tuple[bytes, str]:
        """The exposition text (classic text format 0.0.4) and its content type: our
        names, vLLM's (`vllm:*`, see with_vllm_names) or both (--metrics-names)."""
        text = generate_latest(self.registry).decode()
        if self.names != "pagedserve":
            text = with_vllm_names(text, keep_ours=self.names == "both")
        return text.encode(), CONTENT_TYPE_PLAIN_0_0_4


# The families vLLM exposes with the same meaning as ours (vLLM's metrics catalogue):
# routers and the vLLM dashboards read these under `vllm:` (llm-d's endpoint picker:
# num_requests_waiting, kv_cache_usage_perc, cache_config_info, lora_requests_info).
VLLM_FAMILIES = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens",
    "generation_tokens", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
    "request_success", "time_to_first_token_seconds", "inter_token_latency_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds",
    "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
    "request_generation_tokens", "request_time_per_output_token_seconds",
    "iteration_tokens_total", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
    "cache_config", "lora_requests",
})
_SAMPLE_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_info", "")
_NUM_BLOCKS_LABEL = re.compile(r'num_blocks="(\d*)"')


def _vllm_family(name: str) -> str | None:
    """The VLLM_FAMILIES entry a sample or family name (ours, prefixed) belongs to.
    Example: pagedserve:prompt_tokens_total -> prompt_tokens; pagedserve:
    iteration_tokens_total_bucket -> iteration_tokens_total."""
    if not name.startswith(PREFIX):
        return None
    bare = name[len(PREFIX):]
    for suffix in _SAMPLE_SUFFIXES:
        if bare.endswith(suffix) and bare[: len(bare) - len(suffix)] in VLLM_FAMILIES:
            return bare[: len(bare) - len(suffix)]
    return None


def with_vllm_names(text: str, keep_ours: bool = True) -> str:
    """An exposition with each VLLM_FAMILIES family also (or, without `keep_ours`, only)
    under `vllm:`, the same values; `vllm:cache_config_info` also carries vLLM's
    num_gpu_blocks label. Example: `pagedserve:num_requests_waiting{model_name="m"} 3.0` ->
    that line and `vllm:num_requests_waiting{model_name="m"} 3.0`."""
    ours, theirs = [], []
    for line in text.splitlines():
        name = line.split(" ", 3)[2] if line.startswith("# ") else \
            line.split("{", 1)[0].split(" ", 1)[0]
        if _vllm_family(name) is None:
            ours.append(line)
            continue
        if keep_ours:
            ours.append(line)
        copy = line.replace(PREFIX, "vllm:", 1)
        if _vllm_family(name) == "cache_config" and not line.startswith("# "):
            copy = _NUM_BLOCKS_LABEL.sub(lambda m: f'{m.group(0)},num_gpu_blocks="{m.group(1)}"',
                                         copy, count=1)
        theirs.append(copy)
    return "\n".join(ours + theirs) + "\n"


def finish_reason(output: RequestOutput) -> str:
    """One finish reason for a request of n sequences: abort > length > stop."""
    reasons = {o.finish_reason for o in output.outputs}
    for reason in ("abort", "length", "stop"):
        if reason in reasons:
            return reason
    return "abort"  # unfinished sequences (or unknown reasons): the request was cut short
