"""Serving: the engine (prefill / insert / generate over a slots KV cache), the scheduler thread, the
OpenAI request/response layer and the Starlette HTTP app.

May import: flaxgpt.decode (the row sampling), flaxgpt.data.chat (chat templates). The HTTP layer
(server, openai_api, scheduler) imports no model module; building an engine for a model happens in
launch.
"""
