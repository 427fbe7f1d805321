"""Serving: the core in three parts, the scheduler thread (who runs, each turn's tokens under one budget),
the block manager (which page of the one KV pool holds what: block tables, prefix hashes, reference
counts, eviction) and the runner (the pool and the slots on the device, the jitted programs), joined by
the engine (prefill / insert / generate); LoRA adapters (a host pool, LRU over device slots), the
OpenAI request/response layer with what applications send beside prompts (grammar: structured outputs
as token bitmasks; tools: tool calls parsed and forced; detokenize: the text that follows the prompt),
the Starlette HTTP app with its operations middleware (API key, limits, access log) and Prometheus
metrics; replay: one engine over the processes of a job (process 0's engine calls broadcast as plans,
replayed by the others).

May import: flaxgpt.decode (the decode loop and row sampling), flaxgpt.data (chat templates,
tokenizers), flaxgpt.models (the cache kinds models.cache and models.paged for the engine and the
runner; the model itself in launch), flaxgpt.loader, flaxgpt.sharding, flaxgpt.cluster (launch: joining
a multi-process job).

The HTTP layer (server, openai_api, scheduler, adapters, middleware, metrics, grammar, tools, detokenize)
imports no model module;
building an engine for a model happens in launch.
"""
