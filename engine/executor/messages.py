"""Typed messages between the engine core (the executor) and its worker ranks.

    core --(ToWorker)--> every rank:   InitKVCache | Step | Stop
    rank --(FromWorker)--> core:       WorkerReady | KVCacheReady | StepDone (rank 0 only)
                                       | WorkerFailed

msgpack via msgspec, decoded strictly into these structs and the engine's own
dataclasses (SchedulerOutput, ModelRunnerOutput): nothing is pickled. The one
non-dataclass value a step carries, a torch tensor (a grammar bitmask), travels as
(dtype name, shape, raw bytes).
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from engine.kv_cache.groups import KVCacheGroupSpec
from engine.outputs import ModelRunnerOutput
from engine.sched import output as _sched_output
from engine.sched.output import SchedulerOutput

# msgspec resolves the dataclasses' string annotations in their own modules; one that
# names torch only under TYPE_CHECKING would not resolve without this.
vars(_sched_output).setdefault("torch", torch)


class InitKVCache(msgspec.Struct, tag="init_kv_cache"):
    """Allocate this many KV blocks (the minimum every rank can hold)."""

    num_blocks: int


class Step(msgspec.Struct, tag="step"):
    scheduler_output: SchedulerOutput


class Stop(msgspec.Struct, tag="stop"):
    pass


class WorkerReady(msgspec.Struct, tag="worker_ready"):
    """Model loaded and profiled; `num_blocks` is what this rank's KV budget holds."""

    rank: int
    pid: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    kv_cache_groups: list[KVCacheGroupSpec] | None = None


class KVCacheReady(msgspec.Struct, tag="kv_cache_ready"):
    rank: int


class StepDone(msgspec.Struct, tag="step_done"):
    output: ModelRunnerOutput


class WorkerFailed(msgspec.Struct, tag="worker_failed"):
    """The rank hit an error it cannot recover from (at start-up or in a step) and exits."""

    rank: int
    message: str
    traceback: str = ""


ToWorker = InitKVCache | Step | Stop
FromWorker = WorkerReady | KVCacheReady | StepDone | WorkerFailed


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        array = obj.detach().cpu().contiguous()
        return {"dtype": str(array.dtype).removeprefix("torch."), "shape": list(array.shape),
                "data": array.view(torch.uint8).numpy().tobytes() if array.numel() else b""}
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to a worker rank")


def _dec_hook(typ: type, obj: Any) -> Any:
    if typ is torch.Tensor:
        dtype = getattr(torch, obj["dtype"])
        flat = torch.frombuffer(bytearray(obj["data"]), dtype=torch.uint8) if obj["data"] \
            else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(obj["shape"]) if flat.numel() else \
            torch.empty(obj["shape"], dtype=dtype)
    raise NotImplementedError(f"cannot decode a {typ}")


class WorkerCodec:
    """Encoder and decoder for one side of the channel; one per thread."""

    def __init__(self, decode_type: Any):
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoder = msgspec.msgpack.Decoder(decode_type, dec_hook=_dec_hook)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes | memoryview) -> Any:
        return self._decoder.decode(data)


def core_side_codec() -> WorkerCodec:
    return WorkerCodec(FromWorker)


def worker_side_codec() -> WorkerCodec:
    return WorkerCodec(ToWorker)

