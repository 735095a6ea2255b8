"""LoRA adapters served on one base model (issue 44).

    checkpoint.py  reading and checking a PEFT adapter (adapter_config.json + weights)
    layers.py      the low-rank side path of a Linear and the step's token -> adapter map
    manager.py     the worker's adapters: attached to the model's linears, loaded on first
                   use, least recently used ones dropped past --max-cpu-loras

Which adapter a request runs under is an engine/lora_request.py LoRARequest (a shared
type: the scheduler and the KV cache read it). A request's adapter changes its KV, so
its id is one of its prefix-cache keys (engine/request.py); the scheduler runs at most
--max-loras adapters in one step.
"""
