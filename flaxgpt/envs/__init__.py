"""Environments for reinforcement learning with tools: what an episode's model talks to between turns.

An environment is a class a user writes in a Python file and names in the recipe as `module:Class`, as
reward functions are named today (base: the interface, its checks and the episode loop). Two ship
(calculator): a calculator (arithmetic parsed, never evaluated as Python) and a Python executor over
sandbox (a subprocess with CPU-time, memory, output and wall-clock limits, no network, no child
processes, writes only inside its own temporary directory). Tool calls are read with the serving
code's parsers (flaxgpt.serve.tools), so a model trained against these environments calls tools the
way serve.py reads them.

May import: flaxgpt.serve (tools: the tool-call parsers), flaxgpt.errors.
"""
