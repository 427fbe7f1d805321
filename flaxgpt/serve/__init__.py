"""Serving: the engine (prefill / insert / generate over a slots KV cache; chunked prefill), the prefix
cache (block KV reused across prompts), the paged engine's page bookkeeping (one pool shared by the slots
and the prefix cache), LoRA adapters (a host pool, LRU over device slots), the
scheduler thread, the OpenAI request/response layer, the
Starlette HTTP app with its operations middleware (API key, limits, access log) and Prometheus metrics.

May import: flaxgpt.decode (the decode loop and row sampling), flaxgpt.data (chat templates,
tokenizers), flaxgpt.models (the cache kinds models.cache and models.paged for the engine and the
prefix cache; the model itself in launch), flaxgpt.loader, flaxgpt.sharding.

The HTTP layer (server, openai_api, scheduler, adapters, middleware, metrics) imports no model module;
building an engine for a model happens in launch.
"""
