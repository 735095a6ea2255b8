"""The Executor contract, and how the engine core gets one.

    EngineCore ──initialize()──▶ Executor ──▶ KVCacheInfo (blocks, block size, lengths)
               ──execute_model(SchedulerOutput)──▶ ModelRunnerOutput   (once per step)
               ──shutdown()──▶

Two implementations, and the core never knows which it holds:

    ModelExecutor      engine/worker/executor.py             one Worker in the core's process
    MultiprocExecutor  engine/executor/multiproc_executor.py one worker process per
                                                             tensor-parallel rank
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.config import EngineConfig
from engine.outputs import KVCacheInfo, ModelRunnerOutput
from engine.sched.output import SchedulerOutput


class Executor(Protocol):
    """Runs the model. `make_executor` picks the real one; tests pass fakes."""

    def initialize(self) -> KVCacheInfo: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


def make_executor(config: EngineConfig) -> Executor:
    """The executor for `config`: one process, or one worker process per TP rank.

    Imported here, not at the top: both pull in torch and the models, which the
    frontend and the fake executors of the tests never need."""
    if config.parallel_config.tensor_parallel_size > 1:
        from engine.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    from engine.worker.executor import ModelExecutor

    return ModelExecutor(config)


@dataclass(frozen=True)
class ExecutorSpec:
    """How to build an executor inside the core process without pickling one.

    `factory` is "package.module:callable"; it is called as `factory(config, **kwargs)`.
    Tests use this to run a fake executor behind the real process machinery.
    """

    factory: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self, config: EngineConfig) -> Executor:
        module_name, _, attr = self.factory.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
        return factory(config, **self.kwargs)
