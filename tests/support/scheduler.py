"""Scheduler test helpers: a small scheduler, requests, and fake model-runner steps.

Shared by tests/unit/sched/ and tests/server/test_metrics.py.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator

from engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from engine.lora_request import LoRARequest
from engine.multimodal.inputs import ImageFeature
from engine.outputs import EngineCoreOutputs, ModelRunnerOutput
from engine.request import EngineCoreRequest, Request
from engine.sampling_params import SamplingParams
from engine.sched import Scheduler, SchedulerOutput

BLOCK_SIZE = 4
EOS = 2
_prompt_starts = itertools.count(10_000, 10_000)  # distinct prompts never share a prefix


def make_scheduler(
    num_blocks: int = 100,
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    policy: str = "fcfs",
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    max_loras: int = 0,
    max_num_encoder_input_tokens: int = 0,
    encoder_cache_size: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            policy=policy,
            max_model_len=max_model_len,
            max_num_encoder_input_tokens=max_num_encoder_input_tokens,
            encoder_cache_size=encoder_cache_size,
        ),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
        max_loras=max_loras,
    )


def add(
    scheduler: Scheduler,
    req_id: str,
    prompt: list[int] | int,
    *,
    priority: int = 0,
    arrival_time: float | None = None,
    cache_salt: str | None = None,
    lora_request: LoRARequest | None = None,
    mm_features: list[ImageFeature] | None = None,
    **params,
) -> Request:
    """Queue a request; an int prompt means that many distinct tokens."""
    if isinstance(prompt, int):
        start = next(_prompt_starts)
        prompt = list(range(start, start + prompt))
    params.setdefault("max_tokens", 100)
    core = EngineCoreRequest(req_id, prompt, SamplingParams(**params), eos_token_id=EOS,
                             priority=priority, cache_salt=cache_salt,
                             lora_request=lora_request, mm_features=mm_features)
    if arrival_time is not None:
        core.arrival_time = arrival_time
    return scheduler.add_request(core)


def default_token(request: Request) -> int:
    return 1000 + request.num_tokens  # never EOS, never a stop token of these tests


def fake_runner_output(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    sample: Callable[[Request], int] = default_token,
) -> ModelRunnerOutput:
    """What a model runner would return: one token for each request whose tokens are
    all computed after this step (the scheduler has already advanced
    `num_computed_tokens`), nothing for requests in the middle of a prefill."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)  # None: aborted while the step ran
        done = request is not None and request.num_computed_tokens == request.num_tokens
        sampled.append([sample(request)] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def step(
    scheduler: Scheduler, sample: Callable[[Request], int] = default_token
) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    scheduler_output = scheduler.schedule()
    runner_output = fake_runner_output(scheduler, scheduler_output, sample)
    return scheduler_output, scheduler.update_from_output(scheduler_output, runner_output)


def run_to_completion(scheduler: Scheduler, max_steps: int = 1000, **kwargs) -> list:
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        outputs.extend(step(scheduler, **kwargs)[1].outputs)
    raise AssertionError("requests did not finish")


def output_of(engine_outputs: EngineCoreOutputs, req_id: str):
    matches = [o for o in engine_outputs.outputs if o.req_id == req_id]
    assert len(matches) == 1, engine_outputs.outputs
    return matches[0]


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert scheduler.kv_cache_manager.req_to_blocks == {}


def waiting_ids(scheduler: Scheduler) -> list[str]:
    return [request.req_id for request in scheduler.waiting]


def running_ids(scheduler: Scheduler) -> list[str]:
    return [request.req_id for request in scheduler.running]


@contextlib.contextmanager
def grammar_scheduler(tokenizer, vocab_size: int,
                      speculative_config: SpeculativeConfig | None = None
                      ) -> Iterator[Scheduler]:
    """A small scheduler with a structured-output manager over `tokenizer` (shut down on
    exit): tests/engine/test_structured_engine.py and test_spec_decode_grammar.py."""
    from engine.structured_output import StructuredOutputManager

    manager = StructuredOutputManager(lambda: tokenizer, vocab_size)
    try:
        yield Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=128),
                        CacheConfig(block_size=4), 64, structured_output=manager,
                        speculative_config=speculative_config)
    finally:
        manager.shutdown()
