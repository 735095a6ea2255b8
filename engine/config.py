"""Engine configuration: frozen dataclasses built once at start-up.

Values discovered at start-up (like the number of KV blocks) are returned by the
code that finds them, never written back here.

Every option a user sets is declared once, on its field, with `option(...)`: its default,
its help, its flag and the group `pagedserve serve --help` lists it in. From those
declarations the CLI builds its flags (server/http/cli.py), `LLM(**options)` takes the same
names and defaults (engine/frontend/llm.py), and `EngineConfig.from_options` builds the
config for both:

    max_num_seqs: int = option(128, "--max-num-seqs", "Most sequences running in one step.",
                               group="scheduler", type=positive_int)
        -> flag --max-num-seqs (env PAGEDSERVE_MAX_NUM_SEQS), keyword LLM(max_num_seqs=...),
           EngineConfig.from_options(model, max_num_seqs=64).scheduler_config.max_num_seqs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

SchedulingPolicy = Literal["fcfs", "priority"]

# The groups of `pagedserve serve --help`, in its order.
OPTION_GROUPS = ("model", "cache", "scheduler", "parallel", "speculative", "lora", "server",
                 "limits", "observability")


@dataclass(frozen=True)
class Option:
    """How a config field is set from outside: its flag, help text and --help group.

    `flag` None: a keyword of `LLM` only (no flag). `type` parses the flag's text (and
    its environment variable's); `LLM` runs a string value through it too. A field whose
    default is a bool is a switch (`--flag`; with `negatable` also `--no-flag`).
    `default_text`: how --help shows the default, where str() would not say it (bytes)."""

    help: str
    group: str
    flag: str | None = None
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    negatable: bool = False
    default_text: str | None = None

    def __post_init__(self) -> None:
        if self.group not in OPTION_GROUPS:
            raise ValueError(f"option group {self.group!r} is not one of {OPTION_GROUPS}")


def option(default: Any, flag: str | None, help: str, *, group: str,
           default_factory: Callable[[], Any] | None = None, **how: Any) -> Any:
    """A dataclass field with its default (or `default_factory`) and its `Option` (see
    the module doc)."""
    metadata = {"option": Option(help=help, group=group, flag=flag, **how)}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


class Declared(NamedTuple):
    """One declared option of a config class."""

    name: str  # the CLI's dest and LLM's keyword: the flag without "--", "-" -> "_"
    field: str  # the dataclass field it sets (e.g. name "scheduling_policy", field "policy")
    default: Any  # the field's default (None where it is a factory's)
    option: Option


def declared_options(cls: type) -> list[Declared]:
    """The options declared on `cls`'s fields, in field order."""
    out = []
    for f in dataclasses.fields(cls):
        opt = f.metadata.get("option")
        if opt is None:
            continue
        name = opt.flag.removeprefix("--").replace("-", "_") if opt.flag else f.name
        default = None if f.default is dataclasses.MISSING else f.default
        out.append(Declared(name, f.name, default, opt))
    return out


def from_options(cls: type, values: Mapping[str, Any], options: list[Declared] | None = None,
                 **fields: Any) -> Any:
    """`cls(**fields)` with each declared option (by name) set from `values`; an option
    absent or None there keeps its field's default. A string for an option whose type is
    not str is parsed like the flag's text ("2G" for kv_cache_memory)."""
    for declared in declared_options(cls) if options is None else options:
        value = values.get(declared.name)
        if value is None:
            continue
        if isinstance(value, str) and declared.option.type is not str:
            value = declared.option.type(value)
        fields[declared.field] = value
    return cls(**fields)


# ------------------------------------------------------------------ flag value parsers
# Each takes the flag's text; argparse reports an ArgumentTypeError's message as the
# flag's error (and a ValueError as "invalid <name> value").


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def byte_size(text: str) -> int:
    """A byte count with an optional K/M/G/T suffix (parse_size)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def open_fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return value


# --cpu-turns NAME names a file (engine/core/cpu_turns.py).
CPU_TURNS_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def cpu_turns_name(text: str) -> str:
    if not CPU_TURNS_NAME_RE.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: use 1-64 letters, digits, '_', '.' or '-'")
    return text


def seconds(text: str) -> float:
    value = float(text)
    if not value >= 0.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def positive_seconds(text: str) -> float:
    value = seconds(text)
    if value == 0.0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds")
    return value


def json_object(text: str) -> dict[str, Any]:
    """A JSON object: '{"temperature": 0.7, "top_p": 0.9}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


# --hf-overrides: the config.json keys it may set (what a causal-LM reranker needs to be
# served as a sequence classifier, as vLLM spells them; engine/model_loader/hf_config.py).
HF_OVERRIDE_KEYS = ("architectures", "classifier_from_token", "is_original_qwen3_reranker",
                    "method", "use_pad_token")


def scores_from_two_tokens(values: Mapping[str, Any] | Any) -> bool:
    """Whether a config (a dict, or a transformers config) asks for a causal LM's two
    tokens' logits as its score: vLLM's is_original_qwen3_reranker, or its method
    from_2_way_softmax."""
    get = values.get if isinstance(values, Mapping) else (lambda k: getattr(values, k, None))
    return bool(get("is_original_qwen3_reranker")) or get("method") == "from_2_way_softmax"


def check_hf_overrides(value: Mapping[str, Any]) -> None:
    """ValueError naming what is wrong with --hf-overrides' object: a key other than
    HF_OVERRIDE_KEYS, or a value of the wrong kind."""
    unknown = sorted(set(value) - set(HF_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"--hf-overrides: {', '.join(map(repr, unknown))} cannot be overridden "
                         f"(only {', '.join(HF_OVERRIDE_KEYS)})")
    architectures = value.get("architectures", ["-"])
    if (not isinstance(architectures, list) or not architectures
            or not all(isinstance(a, str) and a for a in architectures)):
        raise ValueError("--hf-overrides: architectures must be a list of class names")
    tokens = value.get("classifier_from_token")
    if tokens is not None and (not isinstance(tokens, list) or len(tokens) != 2 or not all(
            isinstance(t, (str, int)) and not isinstance(t, bool) for t in tokens)):
        raise ValueError("--hf-overrides: classifier_from_token must be two tokens (texts or "
                         'ids), the negative one first: ["no", "yes"]')
    for key in ("is_original_qwen3_reranker", "use_pad_token"):
        if key in value and not isinstance(value[key], bool):
            raise ValueError(f"--hf-overrides: {key} must be true or false")
    if value.get("method", "from_2_way_softmax") != "from_2_way_softmax":
        raise ValueError("--hf-overrides: method may only be from_2_way_softmax")
    if scores_from_two_tokens(value) and tokens is None:
        raise ValueError('--hf-overrides: a reranker scored from two tokens\' logits needs '
                         'classifier_from_token (Qwen3-Reranker: ["no", "yes"])')


def hf_overrides_json(text: str) -> dict[str, Any]:
    """--hf-overrides: a JSON object of HF_OVERRIDE_KEYS (check_hf_overrides)."""
    value = json_object(text)
    try:
        check_hf_overrides(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--hf-overrides: ")) from None
    return value


def generation_config_source(text: str) -> str:
    """--generation-config: "auto", "vllm", or a folder holding a generation_config.json."""
    from engine.sampling_defaults import GENERATION_CONFIG_MODES, read_generation_config_file

    if text in GENERATION_CONFIG_MODES:
        return text
    try:
        read_generation_config_file(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not 'auto', 'vllm' or such a folder: {exc}") from None
    return text


def kv_events_config_json(text: str) -> KVEventsConfig:
    """vLLM's JSON: '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'."""
    try:
        return KVEventsConfig.from_dict(json_object(text))
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def speculative_config_json(text: str) -> SpeculativeConfig:
    """vLLM's JSON: '{"method": "ngram", "num_speculative_tokens": 4, ...}'."""
    value = json_object(text)
    try:
        return SpeculativeConfig.from_dict(value)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a local HF directory, a .gguf file, or a hub id (the CLI's --model)
    served_model_name: str | None = None  # the CLI's --served-model-name (its first name)
    mmproj: str | None = option(  # engine.model_loader.gguf_mmproj
        None, "--mmproj", "A llama.cpp vision projector GGUF (mmproj, as llama-server spells "
        "it) beside a text GGUF --model: serves both, in place, as one vision-language model "
        "(SmolVLM / Idefics3: projector type idefics3).", group="model")
    dtype: str = option(
        "auto", "--dtype", "Activation and dense-weight dtype; 'auto' on CPU picks bfloat16 "
        "where the CPU has native bf16 (avx512_bf16/AMX) and float32 elsewhere; on CUDA it "
        "follows the checkpoint.", group="model",
        choices=("auto", "float32", "bfloat16", "float16"))
    quantization: str = option(  # engine.model_loader.quantize
        "auto", "--quantization", "Weight-only quantization of the linears on CPU: 'auto' "
        "serves a GGUF file's tensors in their own formats, read in place (Q4_K, Q6_K, ... as "
        "stored; Q4_0/Q4_1/Q8_0 as exact int4/int8), and other checkpoints dense; 'int8' or "
        "'int4' quantize any checkpoint at load (groups of 32 columns); 'none' keeps (or, for "
        "a GGUF file, dequantizes) every linear dense.", group="model",
        choices=("auto", "none", "int8", "int4"))
    max_model_len: int | None = option(
        None, "--max-model-len", "Context length (prompt + output tokens). Default: the "
        "model's (an embedding model's: its sentence-transformers max_seq_length).",
        group="model", type=positive_int)
    runner: str = option(  # engine.model_loader.pooling_config
        "auto", "--runner", "What the model serves, as vLLM spells it: 'generate' (text), "
        "'pooling' (embeddings: /v1/embeddings, Ollama's /api/embed), or 'auto' (pooling for "
        "an encoder such as BertModel, else generate).", group="model",
        choices=("auto", "generate", "pooling"))
    hf_overrides: dict[str, Any] | None = option(  # engine.model_loader.hf_config
        None, "--hf-overrides", "config.json values to override, as JSON with vLLM's names; "
        "only what serves a causal-LM reranker as a sequence classifier: architectures, "
        "classifier_from_token, is_original_qwen3_reranker, method, use_pad_token. "
        "Qwen3-Reranker: '{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
        "\"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": "
        "true}' (see docs/embeddings.md).", group="model", type=hf_overrides_json)
    seed: int = option(0, "--seed", "Random seed of the engine (requests without a seed).",
                       group="model", type=int)
    enforce_eager: bool = option(
        False, "--enforce-eager", "CUDA: run decode steps eagerly instead of replaying CUDA "
        "graphs captured at start-up for batch sizes 1, 2, 4, 8, 16, ... up to "
        "--max-num-seqs.", group="model")
    # The chat template (engine/model_loader/chat_templates.py): read by the front ends.
    chat_template: str | None = option(
        None, "--chat-template", "The chat template: a file, the Jinja text itself, or a "
        "built-in's name (gemma, llama3, chatml, phi3, mistral). Default: the model's own; "
        "for a model that carries none, the built-in of its family whose markers are in its "
        "vocabulary. Checked at start-up.", group="model")
    chat_template_content_format: str = option(
        "auto", "--chat-template-content-format", "How message content reaches the "
        "template: 'string' (the text), 'openai' (a list of {\"type\": \"text\"} parts), "
        "'auto' (openai for templates that loop over content, else string).", group="model",
        choices=("auto", "string", "openai"))
    # Sampling defaults (engine/sampling_defaults.py): read by the front ends,
    # not the engine core.
    generation_config: str = option(
        "auto", "--generation-config", "Where unset sampling fields take their defaults from, "
        "as vLLM spells it: 'auto' the model's generation config (generation_config.json, or "
        "a GGUF's general.sampling.* keys: temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens), 'vllm' none of the model's, or a folder holding "
        "a generation_config.json. GET /v1/models shows the defaults in force.", group="model",
        type=generation_config_source)
    override_generation_config: dict[str, Any] | None = option(
        None, "--override-generation-config", "Server-wide sampling defaults over the "
        "model's, as JSON with generation_config.json's names: '{\"temperature\": 0.7, "
        "\"top_p\": 0.9, \"max_new_tokens\": 512}'. A request's own values still win.",
        group="model", type=json_object)
    max_tokens_default: int | None = option(
        None, "--max-tokens-default", "Output tokens at most for a request that sets no "
        "max_tokens (any API). Default: the model's max_new_tokens if its generation config "
        "has one, else the room left in the context.", group="model", type=positive_int)
    # pagedserve_kernels/cpu/group32_activations.h; set in each worker before loading.
    activation_precision: str = option(
        "auto", "--activation-precision", "CPU, packed linears (GGUF Q4_0/Q4_1/Q8_0, Q3_K-Q6_K, "
        "--quantization int4/int8): what the integer kernels round the activations to, per "
        "group of 32: 'int8' (as llama.cpp's Q8_0 blocks: u8 x s8 products, twice the "
        "multiply-adds per instruction with VNNI; prefill takes the integer kernels too), "
        "'int16' (closer to the float model), 'auto' (PAGEDSERVE_ACTIVATION_PRECISION if set, "
        "else int8 on AVX-512 VNNI CPUs and int16 elsewhere).", group="model",
        choices=("auto", "int16", "int8"))
    batch_invariant: bool = option(  # engine.batch_invariant
        False, "--batch-invariant", "Make each request's tokens and logprobs independent of "
        "the requests batched with it (quantized linears and attention take their per-row "
        "kernels for every batch; see README for what it costs).", group="model")

    def __post_init__(self) -> None:
        from engine.sampling_defaults import check_owner_settings

        check_owner_settings(self.generation_config, self.override_generation_config,
                             self.max_tokens_default)
        if self.hf_overrides is not None:
            check_hf_overrides(self.hf_overrides)


# --kv-cache-dtype's choices: "auto" = the model's compute dtype; int8 = rows of int8 with
# a float32 scale each (engine/attention/kv_int8.py), CPU only; fp8 = rows of float8 e4m3
# with a scale each (engine/attention/kv_fp8.py), the Triton backend (CUDA) only.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = option(16, "--block-size", "Tokens per KV-cache block.", group="cache",
                             type=positive_int)
    enable_prefix_caching: bool = option(
        True, "--enable-prefix-caching", "Reuse the KV cache of shared prompt prefixes "
        "(default: on).", group="cache", negatable=True)
    prefix_caching_hash_algo: Literal["sha256", "xxhash"] = "sha256"
    kv_cache_memory_bytes: int | None = option(  # CPU; None = a share of free RAM
        None, "--kv-cache-memory", "Bytes for the KV cache on CPU, with an optional K/M/G "
        "suffix (e.g. 2G). Default: a share of free memory.", group="cache", type=byte_size)
    gpu_memory_utilization: float = option(
        0.9, "--gpu-memory-utilization", "Fraction of GPU memory this server may use "
        "(weights, activations and KV cache).", group="cache", type=fraction)
    num_gpu_blocks_override: int | None = option(
        None, "--num-gpu-blocks-override", "Use exactly this many KV-cache blocks (testing).",
        group="cache", type=positive_int)
    # KV cache element type: "auto" = the model's compute dtype; on CPU also "float16" or
    # "bfloat16" under a float32 model (half the bytes per token read by attention).
    kv_cache_dtype: str = option(
        "auto", "--kv-cache-dtype", "Element type of the KV cache: auto = the model's dtype; "
        "on CPU float16 or bfloat16 under a float32 model halve the bytes attention reads per "
        "token (and double the tokens a --kv-cache-memory holds), at that rounding of keys "
        "and values; int8 (CPU) halves them again against bfloat16: each token's key and "
        "value per head rounded to int8 with a scale of its own; fp8 (CUDA, the triton "
        "backend) the same in float8 e4m3.", group="cache",
        choices=KV_CACHE_DTYPES)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters on the base model (engine/lora/), as vLLM spells the flags."""

    enable_lora: bool = option(
        False, "--enable-lora", "Serve LoRA adapters (PEFT checkpoints) on the base model: "
        "a request picks one by its 'model' (server: --lora-modules, /v1/load_lora_adapter).",
        group="lora")
    max_loras: int = option(
        1, "--max-loras", "Most adapters one step runs (requests of another adapter wait "
        "for a slot).", group="lora", type=positive_int)
    max_lora_rank: int = option(
        16, "--max-lora-rank", "Highest adapter rank accepted.", group="lora",
        type=positive_int)
    max_cpu_loras: int | None = option(  # None: max_loras
        None, "--max-cpu-loras", "Adapters kept loaded in memory (least recently used "
        "ones are dropped and read again when asked for). Default: --max-loras.",
        group="lora", type=positive_int)

    def __post_init__(self) -> None:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least "
                             f"--max-loras ({self.max_loras})")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = option(128, "--max-num-seqs", "Most sequences running in one step.",
                               group="scheduler", type=positive_int)
    max_num_batched_tokens: int = option(
        2048, "--max-num-batched-tokens", "Most tokens computed in one step (longer prompts "
        "are prefilled in chunks).", group="scheduler", type=positive_int)
    enable_chunked_prefill: bool = option(
        True, None, "Prefill a prompt longer than the step's token budget over several "
        "steps.", group="scheduler")
    policy: SchedulingPolicy = option(
        "fcfs", "--scheduling-policy", "'fcfs' (arrival order) or 'priority' (the request's "
        "'priority' field, lower first).", group="scheduler", choices=("fcfs", "priority"))
    # Schedule step N+1 while step N runs (engine/core/core.py): the engine's own work
    # then hides behind the model's instead of adding to it.
    async_scheduling: bool = option(
        False, "--async-scheduling", "Schedule the next step while the current one runs, so "
        "the engine's own work (scheduling, outputs) overlaps the model instead of adding "
        "to it.", group="scheduler")
    # Images (engine/sched/encoder_cache.py), in encoder output rows (soft tokens):
    # 0 means max_num_batched_tokens.
    max_num_encoder_input_tokens: int = option(
        0, "--max-num-encoder-input-tokens", "Vision models: most image embedding rows "
        "(soft tokens) encoded in one step (0: --max-num-batched-tokens); one image larger "
        "than this still runs, alone.", group="scheduler", type=int)
    encoder_cache_size: int = option(
        0, "--encoder-cache-size", "Vision models: image embedding rows kept between steps, "
        "so that an image is encoded once for every chunk of its prompt and every request "
        "that repeats it (0: --max-num-batched-tokens).", group="scheduler", type=int)
    max_model_len: int = 2048  # resolved from ModelConfig at start-up


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (engine.distributed). Several nodes use torchrun's meaning:
    `nnodes` hosts, this one `node_rank` (0 runs the server), all joining the process
    group at master_addr:master_port (None on one node: a free port)."""

    tensor_parallel_size: int = option(
        1, "--tensor-parallel-size", "Split the model over this many worker processes (one "
        "per GPU on CUDA; on CPU each gets an equal share of the cores), over "
        "torch.distributed (NCCL on CUDA, gloo on CPU). The attention heads, KV heads (or "
        "ranks, when fewer KV heads), intermediate and MoE intermediate sizes must divide "
        "evenly.", group="parallel", type=positive_int)
    nnodes: int = option(
        1, "--nnodes", "Hosts the tensor-parallel ranks span (torchrun's meaning); each runs "
        "tensor-parallel-size / nnodes ranks.", group="parallel", type=positive_int)
    node_rank: int = option(
        0, "--node-rank", "This host's index among --nnodes: 0 runs the HTTP server and the "
        "engine core, the others only worker ranks.", group="parallel", type=int)
    master_addr: str = option(
        "127.0.0.1", "--master-addr", "Address of node 0, where the ranks meet "
        "(torch.distributed's store; the engine core's control socket is on --master-port + "
        "1).", group="parallel")
    master_port: int | None = option(
        None, "--master-port", "Port of the process group's store on node 0. Default on one "
        "node: a free port; required with --nnodes > 1.", group="parallel", type=positive_int)
    # MoE experts: whole experts split over the ranks instead of every expert's columns.
    enable_expert_parallel: bool = option(
        False, "--enable-expert-parallel", "MoE models with --tensor-parallel-size > 1: each "
        "rank holds whole experts, an equal share of them (expert parallel), instead of every "
        "expert's share of columns (tensor parallel). The number of experts must divide.",
        group="parallel")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = option("auto", "--device", "Where the model runs.", group="model",
                         choices=("auto", "cpu", "cuda"))
    attention_backend: str = option(
        "auto", "--attention-backend", "Attention implementation: 'auto' is torch on CPU and, "
        "on CUDA, triton (any power-of-two --block-size from 16) or flash_attn where it is "
        "installed and --block-size is a multiple of 256.", group="model",
        choices=("auto", "torch", "flash_attn", "triton"))
    cpu_threads: int | None = option(  # None = the CPUs we may use
        None, "--cpu-threads", "CPU compute threads of the engine. Default: one per CPU this "
        "process may use (its affinity, capped by a container's CPU quota).",
        group="parallel", type=positive_int)
    # shared: the engine core computes on every CPU we may use; split: one CPU is kept
    # for the HTTP frontend and the core is pinned to the rest (vLLM's CPU layout).
    cpu_layout: str = option(
        "shared", "--cpu-layout", "How the engine core and the HTTP frontend share the CPUs: "
        "'shared' (the core computes on all of them) or 'split' (the first CPU is kept for "
        "the frontend, the core is pinned to the others, as vLLM does).", group="parallel",
        choices=("shared", "split"))
    # engine/core/cpu_turns.py: servers on the same cores whose steps never overlap.
    cpu_turns: str | None = option(
        None, "--cpu-turns", "Take turns on this host's CPUs with the other servers started "
        "with the same --cpu-turns NAME (e.g. a chat model and an embedder): their engine "
        "steps never overlap. Default: off.", group="parallel", type=cpu_turns_name)
    cpu_turns_share: float | None = option(
        None, "--cpu-turns-share", "With --cpu-turns: this server runs in the background "
        "(embeddings, batch work): while a server of the group without this flag has "
        "requests, this one's steps take at most this share of the time (e.g. 0.2); keep "
        "its steps short with --max-num-batched-tokens. Default: a foreground server.",
        group="parallel", type=open_fraction)


SPEC_METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec_decode/), spelled as vLLM's --speculative-config.

    Each step a decoding request may carry up to `num_speculative_tokens` proposed
    tokens that the model verifies in the same forward pass. `ngram` looks the request's
    last `prompt_lookup_max`..`prompt_lookup_min` tokens up earlier in its own tokens;
    `suffix` also looks in this server's recent outputs; `draft_model` runs `model`, a
    smaller checkpoint with the same tokenizer, greedily (engine/worker/draft_model.py).
    With `adaptive_draft_length` a request's drafts are at most `num_speculative_tokens`
    long and follow its acceptance: a fully accepted draft doubles the next one's length,
    a draft rejected at position a makes the next one a + 1 long.
    Back-off: no proposals while more than `disable_by_batch_size` requests run (a wide
    step is compute-bound: verifying costs more than it saves), and a request whose
    acceptance rate falls below `min_acceptance_rate` (after `backoff_min_draft_tokens`
    proposed tokens) stops proposing for `backoff_tokens` generated tokens, twice as long
    for each such window in a row (up to 16x).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    # draft_model: the draft checkpoint (a directory, a .gguf file or a hub id).
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = 4
    adaptive_draft_length: bool = True
    min_acceptance_rate: float = 0.2
    backoff_min_draft_tokens: int = 16
    backoff_tokens: int = 64
    # suffix: how many recent outputs (and prompts) of finished requests it remembers.
    suffix_cache_max_requests: int = 64

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; "
                             f"choose one of {list(SPEC_METHODS)}")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative method "draft_model" needs "model": the draft '
                             "checkpoint (a directory, a .gguf file or a hub id)")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError('"model" is the draft checkpoint of method "draft_model"; '
                             f"method {self.method!r} takes none")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be positive")

    @classmethod
    def from_dict(cls, values: dict) -> SpeculativeConfig:
        """From vLLM's JSON keys; unknown keys are an error (a typo would go unnoticed)."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        values = dict(values)
        # vLLM's default prompt_lookup_min is prompt_lookup_max when only that is given.
        if "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
            values["prompt_lookup_min"] = min(cls.prompt_lookup_min, values["prompt_lookup_max"])
        return cls(**values)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig keys (the ones this server uses); published by
    engine/core/kv_events.py."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" or "null" (vLLM's names); enabling defaults to zmq
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # messages the replay socket can still send
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the sending thread
    topic: str = ""

    @classmethod
    def from_dict(cls, value: dict) -> KVEventsConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown --kv-events-config key(s) {unknown}; expected some of "
                             f"{sorted(known)}")
        if value.get("enable_kv_cache_events") and "publisher" not in value:
            value = {**value, "publisher": "zmq"}
        config = cls(**value)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config publisher {config.publisher!r}: expected "
                             "'zmq' or 'null'")
        if config.buffer_steps < 1 or config.max_queue_size < 1:
            raise ValueError("--kv-events-config buffer_steps and max_queue_size must be >= 1")
        return config

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    # None: no speculative decoding (every step decodes one token per request).
    speculative_config: SpeculativeConfig | None = option(
        None, "--speculative-config", "Speculative decoding, as vLLM spells it: JSON such as "
        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 7, \"prompt_lookup_min\": 2, "
        "\"prompt_lookup_max\": 5}'. Methods: ngram (prompt lookup), suffix (also this "
        "server's recent outputs), draft_model (a smaller model with the same tokenizer, "
        "\"model\": its checkpoint; its KV shares the --kv-cache-memory budget). Extra keys: "
        "disable_by_batch_size (no drafts while more requests run; default 4), "
        "adaptive_draft_length (default true), min_acceptance_rate, backoff_tokens. With "
        "--async-scheduling, steps that may carry drafts run one at a time. Default: off.",
        group="speculative", type=speculative_config_json)
    # None: no KV-cache events (engine/core/kv_events.py KVEventsConfig).
    kv_events_config: KVEventsConfig | None = option(
        None, "--kv-events-config", "Publish KV-cache events (blocks stored, evicted, all "
        "cleared) for KV-aware routers, in vLLM's format: JSON such as "
        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
        "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv-events\"}'. "
        "Default: off.", group="cache", type=kv_events_config_json)

    def __post_init__(self) -> None:
        if self.lora_config.enable_lora and self.parallel_config.tensor_parallel_size > 1:
            raise ValueError("--enable-lora does not run with --tensor-parallel-size > 1 yet "
                             "(the adapters' B matrices are not sharded)")
        device = self.device_config
        if device.cpu_turns_share is not None and device.cpu_turns is None:
            raise ValueError("--cpu-turns-share needs --cpu-turns NAME (the group it shares)")
        if device.cpu_turns is not None and self.scheduler_config.async_scheduling:
            raise ValueError("--cpu-turns does not run with --async-scheduling (a step's "
                             "model work would run past its turn)")

    @classmethod
    def from_options(cls, model: str, served_model_name: str | None = None,
                     **values: Any) -> EngineConfig:
        """The config of `model` with the declared options in `values` (by name, e.g.
        `max_num_seqs=64`; `engine_options()` lists them), the rest at their defaults.
        `speculative_config` may also be a dict of vLLM's keys. Raises TypeError for a
        name that is not an engine option."""
        unknown = sorted(set(values) - {declared.name for declared in engine_options()})
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; see engine_options()")
        if isinstance(values.get("speculative_config"), dict):
            values["speculative_config"] = SpeculativeConfig.from_dict(
                values["speculative_config"])
        if isinstance(values.get("kv_events_config"), dict):
            values["kv_events_config"] = KVEventsConfig.from_dict(values["kv_events_config"])
        return from_options(
            cls, values,
            model_config=from_options(ModelConfig, values, model=model,
                                      served_model_name=served_model_name),
            cache_config=from_options(CacheConfig, values),
            scheduler_config=from_options(SchedulerConfig, values),
            parallel_config=from_options(ParallelConfig, values),
            device_config=from_options(DeviceConfig, values),
            lora_config=from_options(LoRAConfig, values),
        )


def engine_options() -> list[Declared]:
    """Every option of the engine (what `LLM` takes and the CLI's engine flags)."""
    classes = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, DeviceConfig,
               LoRAConfig, EngineConfig)
    return [declared for cls in classes for declared in declared_options(cls)]


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """Parse a byte count with an optional K/M/G/T suffix (binary units).

    Example: "512M" -> 536870912, "1.5G" -> 1610612736, "4096" -> 4096.
    """
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (use bytes with an optional K/M/G/T suffix)")
    number, unit, _ = match.groups()
    return int(float(number) * _SIZE_UNITS[unit.upper()])
