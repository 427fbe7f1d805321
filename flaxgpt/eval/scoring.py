"""Log-likelihoods of continuations under a GPT: a few fixed shapes, every device, compiled once each.

    scorer = Scorer(config, params)                      # a data-parallel mesh over all devices
    scores = scorer.score([(context_ids, continuation_ids), ...])          # -> [Score]
    scores = scorer.score_choices([(context_ids, [cont_ids, ...]), ...])   # -> [[Score, ...]]

A request is scored as lm-evaluation-harness scores it: the continuation's tokens are predicted
from everything before them, the row cut on the left to the last block_size + 1 tokens. Two
savings, neither changing a number beyond float rounding:
- the LM head (a third of GPT-2 124M's forward FLOPs) runs only at the scored positions: the
  model's final hidden states are captured and its own full-width logits are left unused, so XLA
  drops them;
- `score_choices` runs a context once for all its continuations (HellaSwag: 4 endings): the context
  fills a KV cache, then each continuation runs on top of it in turn. Every continuation writes the
  same cache positions, and a query sees only keys at positions <= its own, so a continuation never
  sees the one before it.

Rows are padded to a few lengths (BUCKETS) and a fixed token budget per batch, so a whole
evaluation compiles a handful of programs; batches are split over the devices' `data` axis.

Shape letters: B rows, T time, K scored positions, C continuations per context, D n_embd, V vocab.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxgpt import sharding
from flaxgpt.models.cache import KVCache
from flaxgpt.models.gpt import GPT, GPTConfig, finish_logits

# row lengths: steps of ~1.5x keep padding under a third with few compiled shapes
BUCKETS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


class Score(NamedTuple):
    logprob: float  # sum of the continuation's token log-probabilities (nats)
    greedy: bool  # every continuation token is the model's argmax
    n_tokens: int  # continuation tokens scored


def bucket(n: int, limit: int) -> int:
    """The smallest bucket >= n, at most `limit` (itself a length rows may have)."""
    return min(next((b for b in BUCKETS if b >= n), limit), limit)


def check_request(context, continuation, block_size: int) -> None:
    if not len(context):
        raise ValueError("a context must have at least one token (use the end-of-text token)")
    if not 0 < len(continuation) <= block_size:
        raise ValueError(
            f"a continuation of {len(continuation)} tokens cannot be scored with "
            f"block_size {block_size}; it needs 1 to block_size tokens"
        )


def _final_hidden(config: GPTConfig, params, tokens_BT, positions_BT=None, cache=None):
    """(final LayerNorm output [B, T, D], cache): the model's forward without its head (`hidden`)."""
    out = GPT(config).apply({"params": params}, tokens_BT, positions=positions_BT, cache=cache, hidden=True)
    return (out, None) if cache is None else out


def _token_scores(config: GPTConfig, params, h_BKD, targets_BK):
    """Log-probabilities of the targets and whether each is the argmax, from hidden states."""
    if config.tie_embeddings:
        w_VD = params["wte"]["embedding"][: config.vocab_size]
    else:
        w_VD = params["lm_head"]["kernel"][:, : config.vocab_size].T
    dtype = jnp.dtype(config.dtype)
    # fp32 log-softmax: bf16 loses the tail of the distribution
    logits_BKV = jnp.einsum(
        "bkd,vd->bkv", h_BKD.astype(dtype), w_VD.astype(dtype), preferred_element_type=jnp.float32
    )
    logits_BKV = finish_logits(config, logits_BKV)  # Gemma 2's soft-cap, as the model's own logits
    logprobs_BKV = jax.nn.log_softmax(logits_BKV, axis=-1)
    logprob_BK = jnp.take_along_axis(logprobs_BKV, targets_BK[..., None], axis=-1)[..., 0]
    return logprob_BK, logits_BKV.argmax(-1) == targets_BK


def _sums(logprob_BK, hit_BK, mask_BK):
    return (logprob_BK * mask_BK).sum(-1), (hit_BK | (mask_BK == 0)).all(-1)


@functools.partial(jax.jit, static_argnums=0)
def _score_rows(config: GPTConfig, params, tokens_BT, idx_BK, targets_BK, mask_BK):
    """Rows scored at K positions each: idx_BK (the position predicting targets_BK), mask_BK 0 = padding."""
    h_BTD, _ = _final_hidden(config, params, tokens_BT)
    h_BKD = jnp.take_along_axis(h_BTD, idx_BK[..., None], axis=1)
    return _sums(*_token_scores(config, params, h_BKD, targets_BK), mask_BK)


@functools.partial(jax.jit, static_argnums=0)
def _score_shared(config: GPTConfig, params, ctx_BP, start_B, cont_CBT, targets_CBT, mask_CBT):
    """Contexts (without their last token) once, then C continuations each on top of their cache.

    ctx_BP: each context but its last token, right-padded. cont_CBT: for continuation c, the
    context's last token then the continuation but its last token, placed at positions start_B
    (= context length - 1) onwards; targets_CBT are the continuation's tokens.
    """
    B, P = ctx_BP.shape
    T = cont_CBT.shape[-1]
    # full-length buffers for window layers too: right-padded contexts go in without logits_at,
    # and every continuation goes back to start_B
    cache = KVCache.for_config(config, batch=B, max_len=P + T, ring=False)
    _, cache = _final_hidden(config, params, ctx_BP, jnp.broadcast_to(jnp.arange(P), (B, P)), cache)
    positions_BT = start_B[:, None] + jnp.arange(T)

    def one(cache, xs):
        cont_BT, targets_BT, mask_BT = xs
        h_BTD, cache = _final_hidden(config, params, cont_BT, positions_BT, cache)
        return cache, _sums(*_token_scores(config, params, h_BTD, targets_BT), mask_BT)

    _, (logprob_CB, greedy_CB) = jax.lax.scan(one, cache, (cont_CBT, targets_CBT, mask_CBT))
    return logprob_CB, greedy_CB


class Scorer:
    """Scores (context, continuation) token lists with a GPT on a data-parallel mesh.

    `batch_tokens` bounds the padded tokens of one batch (activation memory); rows per batch are a
    multiple of the device count. `progress` shows a tqdm bar counting scored tokens.
    """

    def __init__(self, config: GPTConfig, params, *, batch_tokens: int = 8192, devices=None, progress=True):
        self.config = config
        self.mesh = sharding.make_mesh(data=-1, fsdp=1, devices=devices)
        self.n_devices = self.mesh.devices.size
        self.params = jax.device_put(params, sharding.replicated(self.mesh))
        self.batch_tokens = batch_tokens
        self.progress = progress
        self.tokens_seen = 0  # context + continuation tokens of the requests scored (before padding)

    def _rows(self, tokens_per_row: int, left: int) -> int:
        """Rows of the next batch: as many as batch_tokens allows, but no more than the `left` rows
        need, rounded up to a power of two per device (few shapes to compile; a 4-question eval
        must not pad to hundreds of rows of vocabulary-wide logits)."""
        n = self.n_devices
        most = max(n, self.batch_tokens // tokens_per_row // n * n)
        return min(most, n * (1 << (max(1, -(-left // n)) - 1).bit_length()))

    def _put(self, *arrays, axis: int = 0):
        spec = [None] * axis + [sharding.BATCH_AXES]
        s = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*spec))
        return [jax.device_put(a, s) for a in arrays]

    def _bar(self, total: int, desc: str):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="tok", unit_scale=True, disable=not self.progress)

    @property
    def block_size(self) -> int:  # the window a request must fit (tasks name the example that does not)
        return self.config.block_size

    def _check(self, context, continuation):
        check_request(context, continuation, self.config.block_size)

    def score(self, requests) -> list[Score]:
        """[(context_ids, continuation_ids)] -> [Score], in order."""
        L = self.config.block_size
        rows = []  # (input ids, first scored position, continuation)
        for context, continuation in requests:
            self._check(context, continuation)
            seq = (list(context) + list(continuation))[-(L + 1) :]  # lm-eval's left truncation
            rows.append((seq[:-1], len(seq) - 1 - len(continuation), list(continuation)))
            self.tokens_seen += len(context) + len(continuation)
        order = sorted(range(len(rows)), key=lambda i: (-len(rows[i][0]), -len(rows[i][2])))
        out: list[Score | None] = [None] * len(rows)
        pending = []
        with self._bar(sum(len(r[2]) for r in rows), "scoring") as bar:
            i = 0
            while i < len(order):  # longest first: a batch is padded to its first row's bucket
                T = bucket(len(rows[order[i]][0]), L)
                B = self._rows(T, len(order) - i)
                chunk = order[i : i + B]
                i += len(chunk)
                K = bucket(max(len(rows[j][2]) for j in chunk), T)
                tokens = np.zeros((B, T), np.int32)
                idx, targets, mask = (np.zeros((B, K), np.int32) for _ in range(3))
                for b, j in enumerate(chunk):
                    inp, start, cont = rows[j]
                    tokens[b, : len(inp)] = inp
                    idx[b, : len(cont)] = start + np.arange(len(cont))
                    targets[b, : len(cont)] = cont
                    mask[b, : len(cont)] = 1
                result = _score_rows(self.config, self.params, *self._put(tokens, idx, targets, mask))
                pending.append((chunk, result, int(mask.sum())))
                if len(pending) > 1:  # fetch the previous batch while this one runs
                    self._collect(pending.pop(0), rows, out, bar)
            for p in pending:
                self._collect(p, rows, out, bar)
        return out

    @staticmethod
    def _collect(p, rows, out, bar):
        chunk, (logprob_B, greedy_B), n = p
        logprob_B, greedy_B = np.asarray(logprob_B), np.asarray(greedy_B)
        for b, j in enumerate(chunk):
            out[j] = Score(float(logprob_B[b]), bool(greedy_B[b]), len(rows[j][2]))
        bar.update(n)

    def score_choices(self, groups) -> list[list[Score]]:
        """[(context_ids, [continuation_ids, ...])] -> per group, one Score per continuation.

        Groups whose context and longest continuation do not fit one window together fall back
        to `score` (which cuts each row on the left as lm-eval does).
        """
        L = self.config.block_size
        shared, single = [], []
        for g, (context, conts) in enumerate(groups):
            for c in conts:
                self._check(context, c)
            T = bucket(max(len(c) for c in conts), L)
            if bucket(len(context) - 1, L) + T <= L:
                shared.append(g)
            else:
                single.append(g)
        out: list[list[Score] | None] = [None] * len(groups)
        if single:
            flat = [(groups[g][0], c) for g in single for c in groups[g][1]]
            scores = iter(self.score(flat))
            for g in single:
                out[g] = [next(scores) for _ in groups[g][1]]
        for g in shared:
            self.tokens_seen += sum(len(groups[g][0]) + len(c) for c in groups[g][1])
        self._score_shared(groups, shared, out)
        return out

    def _score_shared(self, groups, shared, out):
        L = self.config.block_size
        C = max((len(groups[g][1]) for g in shared), default=0)

        order = sorted(shared, key=lambda g: (-len(groups[g][0]), -max(len(c) for c in groups[g][1])))
        total = sum(len(c) for g in shared for c in groups[g][1])
        pending = []
        with self._bar(total, "scoring") as bar:
            i = 0
            while i < len(order):  # longest context first: a batch is padded to its first row's
                P = bucket(len(groups[order[i]][0]) - 1, L)
                B = self._rows(P + C * bucket(max(len(c) for c in groups[order[i]][1]), L), len(order) - i)
                chunk = order[i : i + B]
                T = bucket(max(len(c) for g in chunk for c in groups[g][1]), L)
                B = self._rows(P + C * T, len(order) - i)
                if P + T > L:  # its context cannot share a window with the batch's longest continuation
                    self._score_alone(groups, order[i], out)
                    i += 1
                    continue
                chunk = chunk[:B]  # later contexts are no longer than the first
                i += len(chunk)
                ctx = np.zeros((B, P), np.int32)
                start = np.zeros((B,), np.int32)
                cont, targets, mask = (np.zeros((C, B, T), np.int32) for _ in range(3))
                for b, g in enumerate(chunk):
                    context, conts = groups[g]
                    ctx[b, : len(context) - 1] = context[:-1]
                    start[b] = len(context) - 1
                    for c, tokens in enumerate(conts):
                        n = len(tokens)
                        cont[c, b, :n] = [context[-1], *tokens[:-1]]
                        targets[c, b, :n] = tokens
                        mask[c, b, :n] = 1
                n = int(mask.sum())
                (ctx, start), (cont, targets, mask) = (
                    self._put(ctx, start),
                    self._put(cont, targets, mask, axis=1),
                )
                result = _score_shared(self.config, self.params, ctx, start, cont, targets, mask)
                pending.append((chunk, result, n))
                if len(pending) > 1:
                    self._collect_shared(pending.pop(0), groups, out, bar)
            for p in pending:
                self._collect_shared(p, groups, out, bar)

    def _score_alone(self, groups, g, out):
        context, conts = groups[g]
        out[g] = self.score([(context, c) for c in conts])

    @staticmethod
    def _collect_shared(p, groups, out, bar):
        chunk, (logprob_CB, greedy_CB), n = p
        logprob_CB, greedy_CB = np.asarray(logprob_CB), np.asarray(greedy_CB)
        for b, g in enumerate(chunk):
            conts = groups[g][1]
            out[g] = [
                Score(float(logprob_CB[c, b]), bool(greedy_CB[c, b]), len(t)) for c, t in enumerate(conts)
            ]
        bar.update(n)
