"""Load reports for routers that poll one (SGLang's dialect): GET /v1/loads, GET /get_load.

    smg (the Shepherd Model Gateway) polls  /v1/loads?include=core,disagg,queues,memory
    vllm-router's power_of_two polls        /get_load

This server is one data-parallel rank (dp_rank 0). Its figures come from the frontend's
own counts, never from a guess:

    num_running_reqs   requests in the engine core that it has scheduled at least once
                       (preempted ones included)
    num_waiting_reqs   sequences admitted but not yet scheduled (the queue --max-queued-requests
                       bounds)
    num_used_tokens    KV-cache tokens in use at the last engine step (kv_cache_usage x
                       max_total_num_tokens)
    cache_hit_rate     prefix-cache tokens found / looked up since start-up

Sections other than core and queues (memory, spec, lora, disagg) are not reported: a
client that asks for them gets the core fields only, as from a server without them.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from fastapi import FastAPI

from server.common.errors import APIError
from server.common.state import ServerState
from server.common.version import package_version

SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def rank_load(state: ServerState, include: frozenset[str]) -> dict[str, Any]:
    """This server's load as one SGLang GetLoadsReqOutput (dp_rank 0)."""
    engine, metrics = state.engine, state.metrics
    waiting = state.lifecycle.num_queued_sequences
    running = max(engine.num_unfinished_requests - engine.num_queued_sequences, 0)
    kv = engine.kv_cache_info
    capacity = kv.num_blocks * kv.block_size
    usage = getattr(metrics, "kv_cache_usage_now", 0.0)
    queried, hit = getattr(metrics, "prefix_cache_tokens", (0, 0))
    load = {
        "dp_rank": 0, "timestamp": time.time(),
        "num_running_reqs": running, "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": round(usage * capacity), "max_total_num_tokens": capacity,
        "token_usage": usage, "utilization": usage,
        "cache_hit_rate": hit / queried if queried else 0.0,
        "max_running_requests": state.max_running_requests,
    }
    if include & {"queues", "all"}:
        load["queues"] = {"waiting": waiting, "grammar": 0, "paused": 0, "retracted": 0}
    return load


def _sections(include: str | None) -> frozenset[str]:
    names = frozenset(part.strip() for part in (include or "all").split(",") if part.strip())
    unknown = names - SECTIONS
    if unknown:
        raise APIError(400, f"Unknown include sections: {', '.join(sorted(unknown))} "
                            f"(valid: {', '.join(sorted(SECTIONS))}).", "include",
                       "invalid_value")
    return names


def install_load_routes(app: FastAPI, state: ServerState, auth: list) -> None:
    @app.get("/v1/loads", dependencies=auth)
    async def loads(include: str | None = None, dp_rank: int | None = None,
                    format: str = "json") -> dict[str, Any]:
        """SGLang's load report: one entry per data-parallel rank, and their aggregate."""
        sections = _sections(include)
        if format != "json":
            raise APIError(400, "Only format=json is served; Prometheus reads /metrics.",
                           "format", "invalid_value")
        if dp_rank not in (None, 0):
            raise APIError(400, f"This server is data-parallel rank 0 only, not {dp_rank}.",
                           "dp_rank", "invalid_value")
        load = rank_load(state, sections)
        return {
            "timestamp": datetime.now(timezone.utc).isoformat(), "version": package_version(),
            "dp_rank_count": 1, "loads": [load],
            "aggregate": {
                "total_running_reqs": load["num_running_reqs"],
                "total_waiting_reqs": load["num_waiting_reqs"],
                "total_reqs": load["num_total_reqs"],
                "total_used_tokens": load["num_used_tokens"],
                "total_tokens": load["max_total_num_tokens"],
                "avg_token_usage": load["token_usage"],
                "avg_utilization": load["utilization"],
            },
        }

    @app.get("/get_load", dependencies=auth)
    async def get_load() -> list[dict[str, Any]]:
        """SGLang's older load report, which vllm-router's power_of_two policy polls."""
        load = rank_load(state, frozenset({"core"}))
        return [{"dp_rank": 0, "num_reqs": load["num_total_reqs"],
                 "num_waiting_reqs": load["num_waiting_reqs"],
                 "num_tokens": load["num_used_tokens"], "ts_tic": time.perf_counter()}]
