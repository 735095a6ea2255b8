"""The front end: what turns prompts into engine-core requests and core outputs into text.

    processor         Processor: prompt checks, n fan-out, per-sample seeds
    output_processor  OutputProcessor: detokenize, stop strings, logprobs -> RequestOutput
    detokenizer       incremental, UTF-8 safe detokenization
    async_engine      AsyncEngine: the server's asyncio API over a core client
    llm               LLM: the offline, synchronous API over an in-process EngineCore
    core_client       how a front end talks to the engine core: a thread or its own process
    shared_core_client  ... or one core shared by N API servers (and the launcher's handle)
"""
