"""Typed messages between the frontend and the engine-core process, and their codec.

Everything on the wire is msgpack produced by msgspec from the typed structs below
(which embed the engine's own dataclasses); nothing is pickled. The union of each
direction is decoded strictly, so a malformed message is an error, not a guess.

    frontend --(FrontendMessage)--> core:  AddRequest | AbortRequests | UtilityCall
                                           | GrammarCheck | Ping | XrayCall | Shutdown
    core --(CoreMessage)--> frontend:      Ready | StartupError | Outputs | UtilityResult
                                           | Pong | XrayResult | EngineDead

Ping/Pong is the liveness probe: Ping travels the same way requests do (socket, input
thread, input queue) and the core's busy loop answers it between two steps, so a Pong
proves that the loop itself is making progress, not just that the process exists.

One core, N frontends (`serve --api-server-count N`, server/http/launcher.py): the same
messages travel over other sockets, described by `SharedCoreAddresses`:

    frontend k  DEALER (routing id frontend_identity(k)) ─┐
    launcher    DEALER (routing id LAUNCHER_IDENTITY)   ──┼─▶ ROUTER input.sock   core
                                                          │   (the routing id says who sent it)
    frontend k  PULL output-k.sock ◀──────────────────────┴── PUSH, one per frontend
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import msgspec

from engine.outputs import EngineCoreOutputs, KVCacheInfo
from engine.request import EngineCoreRequest
from engine.xray_schema import XrayLimits, XraySnapshot


class AddRequest(msgspec.Struct, tag="add"):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort"):
    req_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility"):
    """Call a no-argument EngineCore method from `UTILITY_METHODS`; answered by UtilityResult."""

    call_id: int
    method: str


class GrammarCheck(msgspec.Struct, tag="grammar_check"):
    """Check (by compiling it) a structured-output spec the frontend's own checks passed.

    The grammar library imports torch, which the HTTP frontend never loads; the core
    compiles the spec in its grammar threads (caching it for the request that follows)
    and answers UtilityResult(call_id, result=None) when it compiled, or
    UtilityResult(call_id, error=<the library's message>). Call ids share UtilityCall's
    counter."""

    call_id: int
    kind: str
    spec: str


class Ping(msgspec.Struct, tag="ping"):
    """Answered by Pong(ping_id) from the core's busy loop, between two steps."""

    ping_id: int


class XrayCall(msgspec.Struct, tag="xray"):
    """Ask for an engine x-ray snapshot (engine/core/xray.py); the core's loop answers with
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


FrontendMessage = (AddRequest | AbortRequests | UtilityCall | GrammarCheck | Ping | XrayCall
                   | Shutdown)
CoreMessage = Ready | StartupError | Outputs | UtilityResult | Pong | XrayResult | EngineDead

# EngineCore methods a frontend may call through UtilityCall (no arguments).
UTILITY_METHODS = frozenset({"reset_prefix_cache", "has_unfinished_requests"})


@dataclass(frozen=True)
class SharedCoreAddresses:
    """The sockets of one engine core shared by N frontends (see the module doc).

    `input_address`: the core binds a ROUTER there; every frontend, and the launcher
    (which only ever sends Shutdown), connects a DEALER whose routing id says who it is.
    `output_addresses[k]`: frontend k binds a PULL there; the core connects a PUSH to each.
    """

    input_address: str
    output_addresses: tuple[str, ...]

    @classmethod
    def in_dir(cls, ipc_dir: str, num_frontends: int) -> SharedCoreAddresses:
        return cls(f"ipc://{os.path.join(ipc_dir, 'input.sock')}",
                   tuple(f"ipc://{os.path.join(ipc_dir, f'output-{k}.sock')}"
                         for k in range(num_frontends)))


@dataclass(frozen=True)
class SharedCoreLink:
    """What frontend `client_index` needs to join a core the launcher started."""

    addresses: SharedCoreAddresses
    client_index: int
    core_pid: int


LAUNCHER_IDENTITY = b"launcher"


def frontend_identity(client_index: int) -> bytes:
    """The ZMQ routing id of frontend `client_index` on the shared core's input socket."""
    return b"frontend-%d" % client_index


def frontend_index(identity: bytes) -> int | None:
    """The inverse of `frontend_identity`; None for the launcher (or anyone else)."""
    prefix = b"frontend-"
    if identity.startswith(prefix) and identity[len(prefix):].isdigit():
        return int(identity[len(prefix):])
    return None


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
