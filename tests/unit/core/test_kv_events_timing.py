"""When the engine core publishes KV-cache events: a prompt's blocks are announced right
after the step that allocates them is scheduled, before that step's forward runs (as
vLLM's scheduler does), so that a kv_aware router can send the prompt's followers to this
replica while a long prefill is still computing."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core.core import EngineCore
from engine.kv_cache.events import BlockStored, KVEventLog
from engine.request import EngineCoreRequest
from engine.sampling_params import SamplingParams
from tests.support.server_fixtures import FakeExecutor

BLOCK_SIZE = 4


class RecordingPublisher:
    """Stands in for ZmqEventPublisher: keeps every batch it is given."""

    def __init__(self):
        self.batches: list[list] = []

    def publish(self, events) -> None:
        if events:
            self.batches.append(list(events))

    def shutdown(self) -> None:
        pass

    def stored_tokens(self) -> list[int]:
        return [t for batch in self.batches for e in batch if isinstance(e, BlockStored)
                for t in e.token_ids]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_prompts_blocks_are_published_before_its_forward_runs(async_scheduling):
    config = EngineConfig(
        model_config=ModelConfig(model="fake", max_model_len=128),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                         async_scheduling=async_scheduling))
    executor = FakeExecutor(config, vocab_size=1000, num_blocks=32)
    core = EngineCore(config, executor)
    core.scheduler.kv_cache_manager.block_pool.events = KVEventLog(BLOCK_SIZE)
    publisher = RecordingPublisher()
    core.kv_events = publisher

    seen_at_forward: list[list[int]] = []
    execute_model = executor.execute_model

    def recording_execute_model(scheduler_output):
        seen_at_forward.append(publisher.stored_tokens())
        return execute_model(scheduler_output)

    executor.execute_model = recording_execute_model
    prompt = list(range(100, 110))  # two full blocks and two tokens
    core.add_request(EngineCoreRequest("a", prompt, SamplingParams(
        max_tokens=2, temperature=0.0, ignore_eos=True)))
    for _ in range(8):
        if not core.has_unfinished_requests():
            break
        core.step()
    assert seen_at_forward, "no step ran"
    # At the first forward, both full blocks of the prompt were already announced.
    assert seen_at_forward[0] == prompt[:2 * BLOCK_SIZE]
    core.shutdown()
