"""Attention over a mesh's context axis (models/context_attention.py) on 8 simulated CPU devices: the
ring and Ulysses give the single-device attention's outputs and gradients within 1e-5 in float32 for
plain causal, grouped-query, windowed and packed rows (windows and documents crossing the chunks); a
GPT split over the context axis gives the same logits and gradients; bad lengths fail in one line."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flaxgpt import sharding
from flaxgpt.models import context_attention
from flaxgpt.models.attention import attend, causal_mask, segment_mask
from flaxgpt.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.devices(8)

B, T, H, K = 4, 32, 4, 8


def local_attend(window, softcap):
    """The single-device path SelfAttention takes (explicit causal, windowed and segment masks): the
    reference the context axis is checked against, and what SelfAttention hands Ulysses per device."""

    def run(q, k, v, seg):
        Tl = q.shape[1]
        mask = causal_mask(jnp.arange(Tl)[None], Tl, window)
        if seg is not None:
            mask = mask & segment_mask(seg)
        G = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
        return attend(q, k, v, mask, impl="xla", softcap=softcap)

    return run


def split(mesh, impl, window, softcap, packed):
    """context_attention.attend jitted over `mesh`, q/k/v and segment ids split as the model's are."""
    tokens = NamedSharding(mesh, P(sharding.batch_axes(mesh), "context"))
    kw = dict(impl=impl, window=window, softcap=softcap, local_attend=local_attend(window, softcap))

    def run(q, k, v, seg):
        return context_attention.attend(q, k, v, seg if packed else None, **kw)

    return jax.jit(sharding.under_mesh(run, mesh), in_shardings=(tokens,) * 4)


def packed_ids(rng):
    """Documents of random lengths, so boundaries fall inside and across the chunks."""
    cuts = np.sort(rng.choice(np.arange(1, T), size=(B, 5), replace=True), axis=1)
    return jnp.asarray((np.arange(T)[None, None] >= cuts[:, :, None]).sum(1), jnp.int32)


LAYOUTS = {  # name: (key/value heads, window, packed, softcap)
    "plain": (H, 0, False, 0.0),
    "gqa": (2, 0, False, 0.0),
    "mqa_window": (1, 7, False, 0.0),
    "packed": (H, 0, True, 0.0),
    "gqa_window_packed_softcap": (2, 5, True, 30.0),
}


CASES = [(impl, layout, 4, 2) for impl in ("ring", "ulysses") for layout in LAYOUTS]  # data 4 x context 2
# more ring steps: data 2 x context 4, and the whole machine as one context axis
CASES += [("ring", "gqa_window_packed_softcap", 2, 4), ("ring", "gqa_window_packed_softcap", 1, 8)]
CASES += [("ulysses", "gqa_window_packed_softcap", 2, 4)]


@pytest.mark.parametrize("impl, layout, data, context", CASES)
def test_equals_one_device(impl, layout, data, context):
    J, window, packed, softcap = LAYOUTS[layout]
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, h, K)), jnp.float32) for h in (H, J, J))
    seg = packed_ids(rng) if packed else jnp.zeros((B, T), jnp.int32)
    w = jnp.asarray(
        rng.normal(size=(B, T, H, K)), jnp.float32
    )  # the output's cotangent: every element weighed
    mesh = sharding.make_mesh(data=data, fsdp=1, context=context, devices=jax.devices()[: data * context])
    many = split(mesh, impl, window, softcap, packed)
    one = functools.partial(local_attend(window, softcap), seg=seg if packed else None)

    def forward_and_grads(f):  # one program: the output and its vjp against w
        def run(q, k, v):
            y, vjp = jax.vjp(f, q, k, v)
            return y, vjp(w)

        return jax.jit(run)(q, k, v)

    got = forward_and_grads(lambda q, k, v: many(q, k, v, seg))
    want = forward_and_grads(one)
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tiles", [(4, 0), (4, 4)])
def test_ring_in_tiles_equals_one_device(monkeypatch, tiles):
    """Ring blocks taken 4 queries at a time (a device's 16 queries in 4 tiles, the 8 that see a later
    block in 2), with their keys whole (accelerators' Q_TILE) or also 4 at a time (CPU_TILES: the keys'
    softmax merged online, the tiles above the diagonal or past the window skipped) give the same
    outputs and gradients (the forward's map and scan, the backward's scans)."""
    monkeypatch.setattr(context_attention, "CPU_TILES", tiles)
    assert context_attention._tiles(16, 8) == (4, 2 if tiles[1] else 1)
    assert context_attention._tiles(8, 6) == (2, 1)  # a tile that does not divide: the whole block
    test_equals_one_device("ring", "gqa_window_packed_softcap", 4, 2)


def test_balanced_layout_round_trips():
    """The load-balanced layout: device d holds chunks d and 2N-1-d, and the way back is exact."""
    n = 4
    mesh = sharding.make_mesh(data=2, fsdp=1, context=n, devices=jax.devices())
    x = jnp.broadcast_to(jnp.arange(T), (B, T))
    tokens = NamedSharding(mesh, P(sharding.batch_axes(mesh), "context"))

    def both(x):
        d = jax.lax.axis_index("context")
        there = context_attention._to_balanced(x, d, n)
        return there, context_attention._from_balanced(there, d, n)

    spec = P(sharding.batch_axes(mesh), "context")
    fn = jax.shard_map(both, mesh=mesh, in_specs=spec, out_specs=(spec, spec))
    there, back = jax.jit(fn, in_shardings=tokens)(x)
    C = T // (2 * n)
    want = np.concatenate(
        [np.r_[d * C : (d + 1) * C, (2 * n - 1 - d) * C : (2 * n - d) * C] for d in range(n)]
    )
    np.testing.assert_array_equal(np.asarray(there)[0], want)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


def test_a_scanned_ring_keeps_no_step_residuals(monkeypatch):
    """The ring's written-out backward (context_attention._ring_core) keeps only its own q, k, v,
    output and log-sum-exp, also inside a scan over layers (scan_layers): there JAX 0.10 partially
    evaluated the forward's loop over the ring's steps as if it were differentiated and kept every
    step's and query tile's masks and logits ([N-1, tiles, ...]: 109 GB a GPU for one Llama-3-8B layer
    at 128k tokens over 8). Its forward's loops are while loops now (the ring's steps, the key tiles):
    the gradient's compiled temporaries in a scan are the unscanned ones (N = 8, 32 tokens a device in
    4 x 4 tiles: 74,472 bytes against 74,392; 107,480 with a scan over the key tiles; query tiles only:
    168,928 against 62,680 before the while loop, 66,840 for both after)."""
    monkeypatch.setattr(context_attention, "CPU_TILES", (8, 8))
    n, C = 8, 16
    mesh = sharding.make_mesh(data=1, fsdp=1, context=n)
    tokens = NamedSharding(mesh, P(sharding.batch_axes(mesh), "context"))
    x, w = jnp.ones((1, 2 * n * C, 2, 16)), jnp.ones((1, 1, 1, 2, 16))

    def layer(x, w):
        return x + context_attention.attend(x * w, x, x)

    def scanned(x, ws):
        return jnp.sum(jax.lax.scan(lambda x, w: (layer(x, w), None), x, ws)[0] ** 2)

    def plain(x, ws):
        return jnp.sum(layer(x, ws[0]) ** 2)

    def temp_bytes(loss):
        grad = jax.jit(sharding.under_mesh(jax.grad(loss, argnums=1), mesh), in_shardings=(tokens, None))
        return grad.lower(x, w).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(scanned) < 1.5 * temp_bytes(plain)


def tiny_gpt(**kw):
    base = dict(vocab_size=64, block_size=T, n_layer=1, n_head=H, n_embd=32, pos_embedding="rope")
    base.update(norm="rmsnorm", glu=True, activation="silu", bias=False, n_kv_head=2, sliding_window=9)
    base.update(kw)
    return GPTConfig(**base)


@pytest.mark.parametrize(
    "impl, layers", [("ring", {}), ("ulysses", {}), ("ring", {"scan_layers": True, "remat": "full"})]
)
def test_gpt_split_over_context_equals_one_device(impl, layers):
    """A GPT (RoPE, GQA, a window, packed rows; also scanned and rematerialised layers) on data 2 x
    context 4: its logits and parameter gradients are one device's; positions restart per document
    across the chunk boundaries."""
    config = tiny_gpt(context_impl=impl, **layers)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 64, size=(B, T)), jnp.int32)
    seg = packed_ids(rng)
    model = GPT(config)
    params = model.init(jax.random.key(0), tokens)["params"]

    def loss(params, tokens, seg):
        logits = model.apply({"params": params}, tokens, segment_ids_BT=seg)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0]), logits

    mesh = sharding.make_mesh(data=2, fsdp=1, context=4)
    rows = NamedSharding(mesh, P(sharding.batch_axes(mesh)))
    many = jax.jit(
        sharding.under_mesh(jax.value_and_grad(loss, has_aux=True), mesh),
        in_shardings=(sharding.replicated(mesh), rows, rows),
    )
    (l_many, logits_many), g_many = many(params, tokens, seg)
    (l_one, logits_one), g_one = jax.value_and_grad(loss, has_aux=True)(params, tokens, seg)
    np.testing.assert_allclose(logits_many, logits_one, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(l_many, l_one, rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g_many), jax.tree_util.tree_leaves(g_one)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_mesh_axes_and_rules():
    mesh = sharding.make_mesh(data=2, fsdp=2, context=2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "context": 2}
    # a context group is neighbouring devices: the ring's traffic stays between them
    assert [d.id for d in mesh.devices[0, 0]] == [0, 1]
    rules = dict(sharding.rules_for(mesh))
    assert rules["length"] == "context" and rules["batch"] == ("data", "fsdp")
    assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp"))
    assert sharding.batch_devices(mesh) == 4
    expert = dict(sharding.rules_for(sharding.make_mesh(data=1, fsdp=2, expert=2, context=2)))
    assert expert["batch"] == ("data", "fsdp", "expert") and expert["length"] == "context"
    assert dict(sharding.rules_for(sharding.make_mesh(data=8)))["length"] is None


def test_bad_input_one_line():
    with pytest.raises(ValueError, match=r"sequence length 30 is not divisible by 2 x mesh.context = 8"):
        context_attention.check(30, H, 4, "ring")
    with pytest.raises(
        ValueError, match=r"context_impl=ulysses .* mesh.context = 8, which does not divide n_head 4;"
    ):
        context_attention.check(T, 4, 8, "ulysses")
    with pytest.raises(ValueError, match="mesh.context 3 does not divide the 8 devices"):
        sharding.make_mesh(context=3)
    # traced: the attention refuses a length its mesh cannot balance, in one line
    mesh = sharding.make_mesh(data=2, fsdp=1, context=4)
    x = jnp.zeros((B, 12, H, K))
    with pytest.raises(ValueError, match="sequence length 12 is not divisible by 2 x mesh.context = 8"):
        jax.jit(sharding.under_mesh(context_attention.attend, mesh))(x, x, x)
    with pytest.raises(ValueError, match="context_impl='zigzag'"):
        tiny_gpt(context_impl="zigzag")
    # Ulysses around the splash kernel (whose own shard_map would nest inside Ulysses'): refused
    config = tiny_gpt(context_impl="ulysses", attention_impl="pallas")
    tokens = jnp.zeros((B, T), jnp.int32)
    params = jax.eval_shape(GPT(config).init, jax.random.key(0), tokens)["params"]
    apply = sharding.under_mesh(lambda p, t: GPT(config).apply({"params": p}, t), mesh)
    with pytest.raises(ValueError, match="context_impl=ulysses cannot run the splash kernel"):
        jax.jit(apply).trace(params, tokens)


def test_check_context_mesh_owns_the_run_checks():
    """attention.check_context_mesh: what the trainer and `flaxgpt aot` ask before tracing, one owner."""
    from flaxgpt.models import attention

    mesh = sharding.make_mesh(data=2, fsdp=1, context=4)
    attention.check_context_mesh("gpt", tiny_gpt(), mesh)  # 32 tokens over 2 x 4 chunks: fine
    attention.check_context_mesh("seq2seq", None, sharding.make_mesh(data=8))  # no context axis
    with pytest.raises(ValueError, match=r"^mesh.context splits a GPT's sequences; a seq2seq run takes"):
        attention.check_context_mesh("seq2seq", tiny_gpt(), mesh)
    with pytest.raises(ValueError, match="sequence length 12 is not divisible by 2 x mesh.context = 8"):
        attention.check_context_mesh("gpt", tiny_gpt(block_size=12), mesh)
    # cuDNN's kernel off an NVIDIA GPU (here: CPU) or in float32: a traceback from inside jax before
    with pytest.raises(
        ValueError, match=r"^attention_impl=cudnn runs on NVIDIA GPUs in bfloat16 or float16, not on cpu"
    ):
        attention.check_context_mesh("gpt", tiny_gpt(attention_impl="cudnn", dtype="bfloat16"), mesh)
    # refused by the layer once traced, so once the run had written its directory; now before
    with pytest.raises(ValueError, match=r"^attention dropout \(0.1\) needs the whole sequence"):
        attention.check_context_mesh("gpt", tiny_gpt(attn_dropout=0.1), mesh)
    with pytest.raises(
        ValueError, match=r"^context_impl=ulysses cannot run the splash kernel \(attention_impl"
    ):
        attention.check_context_mesh("gpt", tiny_gpt(context_impl="ulysses", attention_impl="pallas"), mesh)
