"""Which adapter a request runs under."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`name`: the model name clients ask for; `lora_id` > 0, unique per adapter loaded in
    this process (never reused, so a name loaded again from other weights gets a new id
    and shares no KV with the old one); `path`: the PEFT adapter's directory."""

    name: str
    lora_id: int
    path: str

    def cache_key(self) -> tuple[str, int]:
        """What the request's first block hash covers for the adapter."""
        return ("lora", self.lora_id)
