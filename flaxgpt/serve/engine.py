"""The serving engine: continuous batching over one page pool, as a block manager and a runner.

    engine = Engine(gpt.step_fn(config, params), config, slots=8, max_len=1024, prefix_blocks=256)
    settings = sampling.Rows.of(sampling.Sampling(temperature=0.8), max_new_tokens=64, seed=7)
    prefix = engine.prefill(prompt_ids, settings)
    engine.insert(prefix, slot=3)              # the request now owns row 3
    job = engine.start_prefill(prompt_ids, rows, adapter=2, salt=b"sql")   # or in chunks:
    while (prefix := engine.prefill_step(job)) is None: ...   # (decode steps may run in between)
    tokens_BC, new_B, done_B = engine.generate()   # up to `chunk` tokens for every busy slot
    engine.keep(3, prompt_ids + reply)         # its end: its blocks stay for the next turn, its pages freed
    first_R, lp_R = engine.insert_group(prefix, [rows_a, rows_b], [6, 7])   # several, one prefill
    first = engine.extend(3, tool_ids, start, rows)   # slot windows: more prompt tokens, no re-prefill

The interface is JetStream's (prefill, insert into a slot, generate for all slots); the scheduler
(serve/scheduler.py) decides who goes where and when. It is made of two parts with one job each:
  serve/block_manager.py  which page holds what: a request's block table, the prefix cache's blocks
                          (hashed with the request's adapter), reference counts, eviction (host only)
  serve/runner.py         the pool and the slots' state on the device, and the jitted programs
This file only joins them: a request's pages are allocated (its cached prefix mapped in place), its
prompt prefilled in chunks through its table, and at `insert` its table becomes its slot's row.
Like `sampling.generate`, the engine sees the model only as `step_fn(tokens_BT, positions_BT, cache)
-> (logits_BTV, cache)`; the cache is an AdapterCache over a PagedKVCache (models/paged.py), and the
multi-LoRA step (models/multi_lora.py) reads each row's adapter slot from it.

Exactness: a row's computation depends only on that row (per-row positions, keys, settings, tables;
no cross-row reductions), and a position's keys and values only on the tokens up to it (and the
adapter: the prefix hashes carry it), so a request decodes the tokens `generate` gives it alone with
the same window, key and settings, however its prompt was split into chunks or taken from the prefix
cache (up to float rounding of matmuls of other shapes).

The pool holds 1 + slots * M + prefix_blocks pages (M = max_len / page): every slot's whole window,
the prefix cache's blocks and the scratch page, so a request always finds its pages. A request must
fit its window: prompt + max_new_tokens <= max_len.

Slot windows (`slot_windows=True`, GRPO's rollouts): each slot owns pages M + b*M .. for good, and
decoding reads them in place (models/paged.py `windows_at`: the pool read as windows, a reshape,
no gather per layer and step); a prefill takes pages for its prompt only, and `insert` copies them
into the slot's window (a group's prompt into each of its slots: nothing shared). No prefix cache and
no draft model then.

Shape letters: B slots, M pages per row, P prompt bucket, C chunk.
"""

from __future__ import annotations

import jax
import numpy as np

from flaxgpt.decode.sampling import Rows
from flaxgpt.models.cache import AdapterCache
from flaxgpt.models.paged import PagedKVCache, paged_impl
from flaxgpt.serve.block_manager import SCRATCH, BlockManager, OutOfPages
from flaxgpt.serve.mixed import mixed_widths, plan_rows
from flaxgpt.serve.prefill_job import PrefillJob, prompt_buckets, slot_owner
from flaxgpt.serve.runner import Logprobs, Prefix, Runner

__all__ = ["Engine", "Logprobs", "Prefix", "PrefillJob", "prompt_buckets"]


class Engine:
    """prefill / insert / generate over one page pool; see the module docstring."""

    def __init__(
        self,
        step_fn,
        config,
        *,
        slots: int,
        max_len: int | None = None,
        chunk: int = 4,
        max_k: int = 256,
        buckets=None,
        prefill_chunk: int | None = None,
        page: int = 16,
        prefix_blocks: int = 0,
        mesh=None,
        impl: str | None = None,
        spare_pages: int = 0,
        speculate: int = 0,
        draft=None,
        slot_windows: bool = False,
        mixed: int = 0,
    ):
        """config: the model's (its layers, key/value heads, head size and dtype size the pool);
        max_len: each request's window (default config.block_size), a multiple of `page`;
        prefill_chunk: the most prompt tokens one prefill call runs (default max_len: a prompt in one
        call); prefix_blocks: the prefix cache's capacity in pages (0: off); mesh: run over its devices
        (see serve/runner.py); impl: the paged-attention path (default: this platform's, paged_impl);
        spare_pages: pages beyond the slots' windows for prefixes held while they are forked (GRPO);
        speculate: drafted tokens a greedy row may have checked per step (`speculate()`; 0: off);
        draft: (step_fn, config) of a smaller model with the same vocabulary that drafts them
        (`speculate_with_draft()`; None: drafts come from the caller, e.g. prompt lookup);
        slot_windows: every slot's window its own pages, read in place (see the module docstring);
        mixed: the most prompt tokens a row feeds in one mixed step (`hold`, `mixed`; 0: off), whose
        widths are the powers of two from 8 below it and it."""
        if slots < 1 or chunk < 1:
            raise ValueError(f"slots and chunk must be >= 1, got slots {slots} chunk {chunk}")
        W = max_len or config.block_size  # whole pages: PagedKVCache.for_slots below says so if not
        self.slots, self.chunk, self.max_k, self.max_len, self.page = slots, chunk, max_k, W, page
        self.prefill_chunk = min(prefill_chunk or W, W)
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.buckets = tuple(buckets or prompt_buckets(self.prefill_chunk))
        if max(self.buckets) != self.prefill_chunk:
            raise ValueError(f"the largest prompt bucket must be {self.prefill_chunk}: {self.buckets}")
        M = W // page
        devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
        if mixed and (slot_windows or draft is not None):  # its held rows would need the draft's too
            raise ValueError("the mixed step runs without slot_windows and without a draft model")
        if slot_windows and (prefix_blocks or draft is not None):
            raise ValueError("slot_windows copies prompts into each slot: no prefix cache, no draft model")
        self.windows = None  # slot_windows: slot b's table [M], pages M + b*M .. (the pool's windows 1..)
        extra = 1 + prefix_blocks + spare_pages  # the scratch page, the prefix cache's, spare
        if slot_windows:  # whole windows: scratch and a prompt's pages, the slots', spare after them
            self.windows = M + np.arange(slots * M, dtype=np.int32).reshape(slots, M)
            extra = -(-(extra + M) // M) * M

        def pool_for(c):  # a model's page pool: every slot's window, then `extra` pages
            kernel = paged_impl(devices[0].platform, c.head_dim, len(devices))
            pool = PagedKVCache.for_slots(c, slots, W, page=page, impl=impl or kernel, extra_pages=extra)
            if slot_windows:
                return AdapterCache.wrap(pool.with_table(self.windows, windows_at=M))
            return AdapterCache.wrap(pool.with_table(np.full((slots, M), SCRATCH, np.int32)))

        pool = pool_for(config)
        self.blocks = BlockManager(
            pages=pool.inner.k[0].shape[1], page=page, M=M, capacity=prefix_blocks,
            reserved=range(M, M + slots * M) if slot_windows else range(0),
        )  # fmt: skip
        self.runner = Runner(
            step_fn, pool, slots=slots, chunk=chunk, max_k=max_k, vocab=config.vocab_size, mesh=mesh
        )
        self.vocab, self.mask_words = config.vocab_size, self.runner.mask_words
        if speculate < 0:
            raise ValueError(f"speculate must be >= 0 (drafted tokens per step), got {speculate}")
        self.speculate_k = speculate
        self.draft = None  # the draft model's Runner: its own pool, indexed by the same block tables
        if draft is not None:
            draft_step, draft_config = draft
            if draft_config.block_size < W:
                raise ValueError(
                    f"the draft model's context ({draft_config.block_size}) is shorter than the window {W}"
                )
            if draft_config.vocab_size != config.vocab_size or not speculate:
                raise ValueError(
                    f"a draft model needs speculate >= 1 and the target's vocabulary ({config.vocab_size} "
                    f"tokens), got speculate {speculate} and {draft_config.vocab_size} tokens"
                )
            draft_pool = pool_for(draft_config)  # the same pages: indexed by the same block tables
            # max_k 0: the draft's tokens are its greedy choices, whatever the request's settings
            self.draft = Runner(
                draft_step, draft_pool, slots=slots, chunk=speculate + 1, max_k=0,
                vocab=draft_config.vocab_size, mesh=mesh,
            )  # fmt: skip
        self.logprobs: Logprobs | None = None  # the last generate's, [B, C] ... (host)
        self._count = np.zeros(slots, np.int32)
        self._stop = np.zeros(slots, bool)
        self._finished = np.ones(slots, bool)  # as the last generate said (free slots too)
        self.held: dict[int, PrefillJob] = {}  # slot -> the prefilling request holding it (`hold`)
        self.mixed_widths = mixed_widths(mixed, W)  # the mixed step's (0: off)

    # the weights: a Partial the scheduler (adapter swaps) and GRPO (each step's weights) replace
    @property
    def step_fn(self):
        return self.runner.step_fn

    @step_fn.setter
    def step_fn(self, step_fn):
        self.runner.step_fn = step_fn

    @property
    def state(self):
        return self.runner.state

    @property
    def n_programs(self) -> int:
        """Prefill per bucket, insert, generate for `chunk` steps and for one step, and the two halves of
        a step under a structured-output mask (the echo prefills compile on the first echo request of
        each bucket), and the speculative step when drafting is on (with a draft model: its prefills,
        insert, its K + 1 decode steps and the state sync too), and with the mixed step its `hold` and
        a step per width."""
        draft = 0 if self.draft is None else len(self.buckets) + 3
        mixed = len(self.mixed_widths) + 1 if self.mixed_widths else 0
        return len(self.buckets) + 4 + (self.chunk > 1) + (self.speculate_k > 0) + draft + mixed

    def kv_memory(self) -> dict:
        """Bytes a slot's whole window takes, and the pool's pages: held by no one, held more than once
        (cached blocks that requests read in place)."""
        return {"bytes_per_slot": self.runner.page_bytes * self.blocks.M, **self.blocks.memory()}

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"prompt of {n} tokens is longer than the context window of {self.max_len} tokens")

    # ------------------------------------------------------------ prefill

    def start_prefill(
        self, prompt_ids, rows: Rows, adapter: int = 0, salt: bytes = b"", hold: bool = False,
        mask=None, echo: bool = False,
    ) -> PrefillJob:  # fmt: skip
        """Check the request and take its pages: its longest cached prefix (blocks hashed from `salt`,
        the adapter's identity: a block of one adapter never matches another's) mapped in place, fresh
        pages up to its last position. adapter: the adapter slot its row decodes with (0: the base);
        hold: keep its pages even if its first token ends it (a prompt to fork); mask: the first token's
        structured-output bitmask (int32 [mask_words]); echo: each prompt token's logprobs wanted (the
        whole prompt runs: nothing taken from the prefix cache). Run the rest with prefill_step."""
        n = len(prompt_ids)
        if n < 1:
            raise ValueError("the prompt is empty; start it with an end-of-text token")
        if n + int(rows.max_new_B[0]) > self.max_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_new_tokens ({int(rows.max_new_B[0])}) exceeds the context "
                f"window of {self.max_len} tokens"
            )
        # slot windows: the prompt's pages only (decoding writes the slot's own)
        last = n - 1 if self.windows is not None else n + int(rows.max_new_B[0]) - 1
        job = PrefillJob(prompt_ids, rows, adapter, 0, last, hold)
        job.mask, job.echo = mask, echo
        # an echoed prompt matches nothing (its salt unique): a cached position has no logits to report
        salt = salt + b"echo" + job.owner[1].to_bytes(8, "little") if echo else salt
        job.hit = job.done_upto = self._with_room(self.blocks.allocate, job.owner, prompt_ids, job.last, salt)
        return job

    def _with_room(self, take, *args):
        """take(*args) (a block manager call that takes pages); short of pages, the slots the last generate
        said were done are ended first (finished slots that no keep or release ended still hold pages)."""
        try:
            return take(*args)
        except OutOfPages:
            for slot in np.flatnonzero(self._finished):
                self._end(int(slot))
            return take(*args)

    def prefill_step(self, job: PrefillJob, tokens: int | None = None) -> Prefix | None:
        """Run the next `tokens` (at most prefill_chunk, the default) prompt tokens of `job`: the Prefix
        after its last chunk, else None. Then the prompt's full blocks join the prefix cache, and its
        pages are the Prefix's (given back at once if its first token ended it and it is not held:
        such a prefix inserts as a finished slot)."""
        start, size = job.done_upto, min(job.left, self.prefill_chunk, tokens or self.prefill_chunk)
        P = self.bucket(size)
        chunk_1P = np.zeros((1, P), np.int32)
        chunk_1P[0, :size] = job.prompt_ids[start : start + size]
        seen = job.seen(self.vocab)
        targets = None
        if job.echo:  # the next prompt token after each position (the last one's is the first new token)
            targets = np.zeros(P, np.int32)
            nxt = job.prompt_ids[start + 1 : start + size + 1]
            targets[: len(nxt)] = nxt
        table, rows = self.blocks.table(job.owner), job.rows
        prefix = self.runner.prefill(table, job.adapter, chunk_1P, start, size, rows, seen, job.mask, targets)
        if self.draft is not None:  # the draft's keys and values of the same positions, in its pool
            self.draft.prefill(table, 0, chunk_1P, start, size, rows)
        job.done_upto = start + size
        if job.echo:
            job.echoed.append(Logprobs(*(np.asarray(x)[:size] for x in prefix.echo)))
        if job.left:
            return None
        if not job.echo:  # an echo's blocks are under its own salt: cached, no request could hit them
            self.blocks.cache(job.owner, job.prompt_ids)
        if not job.hold and bool(prefix.done):
            self.blocks.free(job.owner)
            return prefix
        return prefix._replace(owner=job.owner)

    def prefill(
        self, prompt_ids, rows: Rows, adapter: int = 0, salt: bytes = b"", hold: bool = False,
        mask=None,
    ) -> Prefix:  # fmt: skip
        """Run the prompt through the model; the first new token is in `prefix.first`. Its pages are
        the Prefix's until it is inserted or dropped (hold, mask: see start_prefill)."""
        job = self.start_prefill(prompt_ids, rows, adapter, salt, hold, mask)
        while (prefix := self.prefill_step(job)) is None:
            pass
        return prefix

    def cancel(self, job: PrefillJob | Prefix):
        """Give back the pages of a prefill job or a Prefix that never reached a slot."""
        if job.owner is not None and self.blocks.holds(job.owner):
            self.blocks.free(job.owner)

    drop = cancel  # a held Prefix no longer needed (GRPO: its group is placed)

    # ------------------------------------------------------------ slots

    def insert(self, prefix: Prefix, slot: int):
        """The prefilled request takes slot `slot` (its previous occupant's pages let go); its pages
        become the slot's (the Prefix is consumed: fork it before, not after)."""
        if self.windows is not None:  # its prompt's pages copied into the slot's window
            if prefix.owner is not None:
                self.runner.copy_pages(*self._window_copy(prefix, [slot]))
                self.blocks.free(prefix.owner)
            self.runner.insert(prefix, slot, self.windows[slot])
        elif prefix.owner is None:  # ended by its first token: the slot idles, finished
            self._end(slot)
            self.runner.insert(prefix, slot, np.full(self.blocks.M, SCRATCH, np.int32))
            self._draft_insert(prefix, slot, np.full(self.blocks.M, SCRATCH, np.int32))
        else:
            self.blocks.move(prefix.owner, slot_owner(slot))
            self.runner.insert(prefix, slot, self.blocks.table(slot_owner(slot)))
            self._draft_insert(prefix, slot, self.blocks.table(slot_owner(slot)))
        self._taken([slot])

    def fork(self, prefix: Prefix, rows: Rows) -> Prefix:
        """The prefilled prompt of `prefix` for another request (n completions of one prompt: GRPO's
        group) without a second prefill: the prompt's full blocks shared, its partial block copied, its
        own settings and first token (drawn as a prefill with `rows` draws it). its max_new must fit
        the window as the prefill's did."""
        owner = ("fork", next(PrefillJob._ids))
        length = int(prefix.length)
        if self.windows is not None:  # every prompt page shared (insert copies them into a window)
            whole = -(-length // self.page) * self.page
            copy = self._fork_pages(prefix.owner, owner, whole, whole - 1)
        else:
            copy = self._fork_pages(prefix.owner, owner, length, length + int(rows.max_new_B[0]) - 1)
        self._no_draft("fork")
        self.runner.copy_pages(*copy)
        return self.runner.fork(prefix, rows)._replace(owner=owner)

    def insert_group(self, prefix: Prefix, rows: list[Rows], slots: list[int]) -> tuple[jax.Array, Logprobs]:
        """fork + insert for several requests on one prompt in one call (GRPO's G completions): request
        r takes slot slots[r] with rows[r]; the prefix is consumed. -> their first tokens [R] and those
        tokens' Logprobs (fields [R, ...], as fork's: zeros unless a row asks for them), on the device."""
        if len(rows) != len(slots) or not rows:
            raise ValueError(f"{len(rows)} requests for {len(slots)} slots")
        self._no_draft("insert_group")
        if self.windows is not None:  # the prompt's pages into each slot's window
            src, dst = self._window_copy(prefix, slots)
            tables = self.windows[slots]
        else:  # its full blocks shared, its partial block copied into each slot's own page
            length, src, dst = int(prefix.length), [], []
            for r, slot in enumerate(slots):
                if self.blocks.holds(slot_owner(slot)):
                    self._end(slot)
                s, d = self._fork_pages(
                    prefix.owner, slot_owner(slot), length, length + int(rows[r].max_new_B[0]) - 1
                )
                src, dst = src + s, dst + d
            tables = np.stack([self.blocks.table(slot_owner(s)) for s in slots])
        self.cancel(prefix)
        self.runner.copy_pages(src, dst)
        first_R, lp_R = self.runner.insert_group(prefix, rows, slots, tables)
        self._taken(slots)
        return first_R, lp_R

    def extend(self, slot: int, tokens, start: int, rows: Rows, adapter: int = 0) -> jax.Array:
        """Slot `slot`'s request goes on with `tokens` as prompt tokens at positions start.. (a tool's
        answer between an episode's turns, GRPO's), its history before `start` kept where it is in its
        window, never prefilled again: the tokens run through the slot's table as prefill chunks, and
        the slot decodes again from a first token drawn after them with `rows` (the settings, the key,
        and max_new: the budget from there). Slot windows only (each slot's pages its own). -> that
        first token (on the device)."""
        n, start = len(tokens), int(start)
        if self.windows is None:
            raise ValueError("extend writes into a slot's own window: Engine(slot_windows=True)")
        self._no_draft("extend")
        if n < 1 or start < 1 or rows.penalized:
            raise ValueError(
                f"extend takes >= 1 token after position >= 1 (got {n} at {start}), no penalties"
            )
        if start + n + int(rows.max_new_B[0]) > self.max_len:
            raise ValueError(
                f"{start} positions + {n} new prompt tokens + max_new_tokens {int(rows.max_new_B[0])} "
                f"exceed the context window of {self.max_len} tokens"
            )
        table, done = self.windows[slot], 0
        while done < n:  # in prefill_chunk pieces, each padded to its bucket
            size = min(n - done, self.prefill_chunk)
            chunk_1P = np.zeros((1, self.bucket(size)), np.int32)
            chunk_1P[0, :size] = tokens[done : done + size]
            prefix = self.runner.prefill(table, adapter, chunk_1P, start + done, size, rows)
            done += size
        self.runner.insert(prefix, slot, table)
        self._taken([slot])
        return prefix.first

    def _fork_pages(self, owner, new_owner, length: int, last: int) -> tuple[list[int], list[int]]:
        copy = self._with_room(self.blocks.fork, owner, new_owner, length, last)
        return ([], []) if copy is None else ([copy[0]], [copy[1]])

    def _window_copy(self, prefix: Prefix, slots) -> tuple[list[int], list[int]]:
        """(source, destination) pages that put the prefix's prompt into each slot's window."""
        n = -(-int(prefix.length) // self.page)
        src = self.blocks.table(prefix.owner)[:n].tolist()
        return src * len(slots), [int(p) for s in slots for p in self.windows[s][:n]]

    def _taken(self, slots):
        self._count[slots] = 1
        self._stop[slots] = False
        self._finished[slots] = False

    def keep(self, slot: int, tokens) -> int:
        """Slot `slot`'s request ended: the full blocks of `tokens` (the tokens at its positions 0..: the
        prompt and every generated token but the last, which was never fed) join the prefix cache where
        they are, so a conversation's next turn reuses its whole history; its pages are let go.
        -> blocks newly cached."""
        new = self.blocks.cache(slot_owner(slot), tokens) if self.blocks.holds(slot_owner(slot)) else 0
        self._end(slot)
        return new

    def release(self, slot: int):
        """Stop decoding `slot` before its end (cancelled, or a stop string): from the next generate;
        its pages are given back now, its row idles on the scratch page."""
        self._stop[slot] = True
        self._end(slot)

    def _end(self, slot: int):
        self.held.pop(slot, None)
        if self.blocks.holds(slot_owner(slot)):
            self.blocks.free(slot_owner(slot))
            self.runner.idle(slot, np.full(self.blocks.M, SCRATCH, np.int32))
            if self.draft is not None:
                self.draft.idle(slot, np.full(self.blocks.M, SCRATCH, np.int32))

    def _draft_insert(self, prefix: Prefix, slot: int, table_M):
        """The draft's row for the request: the target's first token to feed, never done before the
        target (no EOS, a whole window of new tokens: it only drafts)."""
        if self.draft is not None:
            rows = prefix.rows.replace(
                max_new_B=np.full((1,), self.max_len, np.int32), eos_B=np.full((1,), -1, np.int32)
            )
            self.draft.insert(prefix._replace(rows=rows, done=np.bool_(False)), slot, table_M)

    def _no_draft(self, what: str):
        if self.draft is not None:
            raise ValueError(f"{what} (GRPO's groups) does not run with a draft model")

    # ------------------------------------------------------------ the mixed step (serve/mixed.py)

    def hold(self, job: PrefillJob, slot: int):
        """The prefilling request `job` takes slot `slot` now (its previous occupant's pages let go): its
        pages become the slot's, its settings the slot's row, which plain steps skip until `mixed` has
        run the rest of its prompt. Not for echo, structured-output, held or drafted requests."""
        if not self.mixed_widths or job.echo or job.hold or job.mask is not None:
            raise ValueError("hold: an Engine(mixed=N) and a request without echo, hold or mask")
        self.blocks.move(job.owner, slot_owner(slot))
        table = self.blocks.table(slot_owner(slot))
        self.runner.hold(slot, table, job.adapter, job.rows, job.seen(self.vocab), job.done_upto)
        self.held[slot], self._count[slot], self._stop[slot], self._finished[slot] = job, 0, False, False

    def mixed(self, plan: dict[int, int]):
        """One step: each held slot in `plan` feeds its next plan[slot] prompt tokens, every decoding slot
        one token -> generate(steps=1)'s outputs; a prompt then in has its first new token there (its
        full blocks join the prefix cache; a first token that ends it frees its pages, as prefill_step)."""
        forced_BT, n_B, ends_B = plan_rows(plan, self.held, self.slots, self.mixed_widths)
        out_B1, count, done, self.logprobs = self.runner.mixed(self._stop.copy(), forced_BT, n_B, ends_B)
        for slot in plan:
            job = self.held[slot]
            job.done_upto += int(n_B[slot])
            if not job.left:
                del self.held[slot]
                self.blocks.cache(slot_owner(slot), job.prompt_ids)
                if done[slot]:
                    self._end(slot)
        return self._after(out_B1, count, done)

    def speculate_with_draft(self, allowed_B):
        """One speculative step with the draft model: it decodes K + 1 greedy tokens for every slot
        from the target's state (the last one only writes the K-th draft's keys), slot b checks the
        first K if allowed_B[b] (greedy rows; others take one plain step) -> speculate()'s outputs."""
        t = self.runner.state
        self.draft.sync(t.last_B, t.fill_B, t.done_B)
        drafts_BC, _, _, _ = self.draft.generate(self._stop.copy(), self.speculate_k + 1)
        drafts_BK = drafts_BC[:, : self.speculate_k]
        n_B = np.where(allowed_B, (drafts_BK >= 0).sum(axis=1), 0)  # PAD (-1) past a row the draft ended
        return self.speculate(np.maximum(drafts_BK, 0), n_B)

    def speculate(self, drafts_BK, n_B):
        """One step in which slot b also checks its n_B[b] drafted tokens drafts_BK[b] (K = speculate,
        greedy rows only: a draft is kept while it is the model's greedy choice) -> generate's outputs,
        tokens_BC of K + 1 columns: each slot 1 to n_B[b] + 1 new tokens for one model call."""
        if np.shape(drafts_BK) != (self.slots, self.speculate_k):
            raise ValueError(f"drafts must be [slots, speculate] = [{self.slots}, {self.speculate_k}]")
        out_BC, count, done, self.logprobs = self.runner.speculate(self._stop.copy(), drafts_BK, n_B)
        return self._after(out_BC, count, done)

    def _after(self, out_BC, count, done):
        """A step's outputs (tokens, new tokens per slot, done), its counts kept for the next."""
        new_B, self._count = count - self._count, count
        self._finished = done & ~np.isin(np.arange(self.slots), list(self.held))  # held: not ended
        return out_BC, new_B, done.copy()

    def generate(self, steps: int | None = None, mask_BW=None):
        """-> (tokens_BC, new_B, done_B): slot b's next new_B[b] tokens are tokens_BC[b, :new_B[b]];
        their logprobs (for rows that asked) in self.logprobs. steps: `chunk` (default) or 1 (one token
        each: a scheduler with prompts still prefilling comes back to them after one step rather than
        `chunk`). mask_BW: one step under a structured-output bitmask (int32 [B, mask_words]), or a
        function that returns it, called while the model runs (Runner.generate_masked)."""
        steps = steps or self.chunk
        if steps not in (1, self.chunk):
            raise ValueError(f"generate runs 1 or chunk ({self.chunk}) steps, got {steps}")
        if mask_BW is None:
            out_BC, count, done, self.logprobs = self.runner.generate(self._stop.copy(), steps)
        elif steps != 1:
            raise ValueError("a structured-output mask holds for one step: generate(steps=1, mask_BW=...)")
        else:
            fill = mask_BW if callable(mask_BW) else lambda: mask_BW
            out_BC, count, done, self.logprobs = self.runner.generate_masked(self._stop.copy(), fill)
        return self._after(out_BC, count, done)
