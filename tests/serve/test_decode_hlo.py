"""The serving step's compiled program on XLA:CPU keeps the two forms that made it fast: regressions that
kept every token equal and only showed as a slower server (serve_load 0.5x d9de538 twice), caught here
from the optimized HLO instead of a benchmark.

- top_k over the row's candidates is XLA:CPU's TopK call, not a sort of the whole vocabulary (aa5fd2e:
  a second slice of lax.top_k's result stopped the rewrite; every sampled step sorted [slots, V]);
- the attention's weighted sums over gathered pages are dots, not products reduced over two axes
  (3500547: the values' sum ran at ~1 GFLOP/s, 44% of the paged group loop).
"""

import re

import jax

from flaxgpt.aot import programs
from flaxgpt.models.gpt_config import GPTConfig

SLOTS, MAX_K = 16, 256


def instructions(hlo: str, op: str) -> list[str]:
    """The lines of `op` instructions (a tuple-typed result has spaces in its type)."""
    return [line for line in hlo.splitlines() if re.search(rf"= .*?[}}\]\)] {op}\(", line)]


def test_generate_step_samples_through_topk_and_attends_through_dots():
    """And `flaxgpt aot` states the KV bytes a slot takes beside the program."""
    config = GPTConfig(vocab_size=2048, n_layer=2, n_head=4, n_embd=128, block_size=256)
    progs = programs.serve_programs(config, jax.devices("cpu")[:1], slots=SLOTS, max_len=256)
    (generate,) = [p for p in progs if p.name == "serve.generate"]
    # what one more slot costs, as /metrics' flaxgpt_kv_bytes_per_slot: keys and values of every layer
    kv_bytes = 2 * config.n_layer * config.n_head * 256 * config.head_dim * 4
    assert f"KV {kv_bytes / 2**20:.1f} MiB a slot" in generate.note
    hlo = generate.trace().lower().compile().as_text()

    topk = [line for line in instructions(hlo, "custom-call") if 'custom_call_target="TopK"' in line]
    assert any(f"f32[{SLOTS},{MAX_K}]" in line for line in topk), "top_k(256) is no longer XLA:CPU's TopK"
    # a sort that lax.top_k lowered to (its op_name ends in top_k): the rewrite into TopK was lost. The
    # one full sort left is the fallback branch (jnp.sort) for rows whose filters reach past max_k.
    sorts = [line for line in instructions(hlo, "sort") if re.search(r'op_name="[^"]*/top_k"', line)]
    assert not sorts, sorts[0][:200]

    # products summed over two axes into a [rows, heads, ..., head_dim] result: a dot written as a
    # reduce (XLA:CPU runs it element by element). Other reductions here are over one axis, or tiny.
    two_axis = [
        line
        for line in instructions(hlo, "reduce")
        if re.search(r"= f32\[\d+(,\d+){2,}\]", line) and re.search(r"dimensions=\{\d+(,\d+)+\}", line)
    ]
    assert not two_axis, two_axis[0][:200]
    assert len(instructions(hlo, "dot")) >= 4 * config.n_layer  # q.k and p.v per layer, and the rest
