"""Typed messages between the frontend and the engine-core process, and their codec.

Everything on the wire is msgpack produced by msgspec from the typed structs below
(which embed the engine's own dataclasses); nothing is pickled. The union of each
direction is decoded strictly, so a malformed message is an error, not a guess.

    frontend --(FrontendMessage)--> core:  AddRequest | AbortRequests | UtilityCall | Ping
                                           | XrayCall | Shutdown
    core --(CoreMessage)--> frontend:      Ready | StartupError | Outputs | UtilityResult
                                           | Pong | XrayResult | EngineDead

Ping/Pong is the liveness probe: Ping travels the same way requests do (socket, input
thread, input queue) and the core's busy loop answers it between two steps, so a Pong
proves that the loop itself is making progress, not just that the process exists.
"""

from __future__ import annotations

import msgspec

from engine.core import KVCacheInfo
from engine.outputs import EngineCoreOutputs
from engine.request import EngineCoreRequest
from engine.xray import XrayLimits, XraySnapshot


class AddRequest(msgspec.Struct, tag="add"):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort"):
    req_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility"):
    """Call a no-argument EngineCore method from `UTILITY_METHODS`; answered by UtilityResult."""

    call_id: int
    method: str


class Ping(msgspec.Struct, tag="ping"):
    """Answered by Pong(ping_id) from the core's busy loop, between two steps."""

    ping_id: int


class XrayCall(msgspec.Struct, tag="xray"):
    """Ask for an engine x-ray snapshot (engine/xray.py); the core's loop answers with
    XrayResult(call_id) between two steps. Call ids share UtilityCall's counter."""

    call_id: int
    limits: XrayLimits


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Ready(msgspec.Struct, tag="ready"):
    """Sent once, after the core (model, KV cache) is built."""

    kv_cache_info: KVCacheInfo
    pid: int


class StartupError(msgspec.Struct, tag="startup_error"):
    """Sent instead of Ready when building the core failed; the process then exits."""

    message: str
    traceback: str = ""


class Outputs(msgspec.Struct, tag="outputs"):
    outputs: EngineCoreOutputs


class UtilityResult(msgspec.Struct, tag="utility_result"):
    call_id: int
    result: bool | int | float | str | None = None
    error: str | None = None


class Pong(msgspec.Struct, tag="pong"):
    ping_id: int


class XrayResult(msgspec.Struct, tag="xray_result"):
    call_id: int
    snapshot: XraySnapshot | None = None
    error: str | None = None


class EngineDead(msgspec.Struct, tag="engine_dead"):
    """The core hit an unrecoverable error; the process exits after sending this."""

    message: str


FrontendMessage = AddRequest | AbortRequests | UtilityCall | Ping | XrayCall | Shutdown
CoreMessage = Ready | StartupError | Outputs | UtilityResult | Pong | XrayResult | EngineDead

# EngineCore methods a frontend may call through UtilityCall (no arguments).
UTILITY_METHODS = frozenset({"reset_prefix_cache", "has_unfinished_requests"})


class Codec:
    """Encoder/decoder pair for one direction; not thread-safe (one per thread)."""

    def __init__(self, decode_type: object):
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decode_type)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes | memoryview):
        return self._decoder.decode(data)


def frontend_codec() -> Codec:
    """The frontend's codec: encodes FrontendMessage, decodes CoreMessage."""
    return Codec(CoreMessage)


def core_codec() -> Codec:
    """The core's codec: encodes CoreMessage, decodes FrontendMessage."""
    return Codec(FrontendMessage)
