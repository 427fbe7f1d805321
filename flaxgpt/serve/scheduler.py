"""The engine's own thread: a bounded queue of sequences, slot bookkeeping, stop strings, streaming.

    sched = Scheduler(engine, tokenizer, max_queue=64)
    sched.start()                                   # compiles every program, then serves
    seq = sched.submit(Sequence(prompt_ids, rows, stop=["\\n\\n"], emit=callback))   # or QueueFull
    seq.cancel()                                    # any thread: its slot is freed before the next chunk
    sched.drain(); sched.close()                    # in-flight sequences finish, new ones are refused

Each turn of the thread starts waiting sequences in every free slot, then plans its tokens under one
budget, `max_num_batched_tokens` (vLLM v1's): a token for each decoding row, the rest prefill chunks of
at most `engine.prefill_chunk` prompt tokens, oldest first, so a long prompt delays running streams by
about one budget of work per turn, not by its whole prefill (every prompt to its end when no slot
decodes: a burst). It emits the first token of each finished prefill at once, then runs one
`engine.generate()` for all slots (one step while prompts are still prefilling or a slot is free for the
next arrival, else `chunk`) and hands each sequence its new tokens. Text is decoded on this thread, a few
tokens at a time against the prompt's last tokens (serve/detokenize.py: the text that follows the
prompt), streamed as it grows, holding back an incomplete UTF-8 character and any tail that could begin a
stop string. A sequence with a grammar (structured outputs, a forced tool call) runs one step at a time:
its Matcher writes its row of the bitmask before each step and takes the token after it; its end ends the
sequence. Logprobs travel with the deltas. A sequence that ends offers its slot's KV (prompt and reply)
to the prefix cache (`engine.keep`) before the slot is reused.

`emit(event)` is called on this thread with `Delta(text)` and then one `Finish(reason, completion_tokens)`
or `Failed(message)` (an event loop hands it over with loop.call_soon_threadsafe). Nothing a sequence does
can stop the thread: errors fail the sequences involved and the loop goes on.

With LoRA adapters (serve/adapters.py) a waiting sequence starts only when its adapter is resident or can be
swapped into a slot no running sequence holds; until then later sequences of other adapters (or the base)
go first. A sequence holds its adapter's slot until it ends. A client gone while queued leaves the queue.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import traceback

import numpy as np

from flaxgpt.decode.sampling import Rows, Sampling
from flaxgpt.serve import ngram
from flaxgpt.serve.detokenize import Detokenizer, WithSpecial, held_back
from flaxgpt.serve.engine import Engine
from flaxgpt.serve.sequence import (
    Delta,
    Draining,
    Failed,
    Finish,
    QueueFull,
    Sequence,
    TokenLogprob,
    TooManySequences,
    TooManyTokens,
)

log = logging.getLogger("flaxgpt.serve")


class _Closed(Exception):
    """The scheduler closed while the engine thread was still compiling its programs."""


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        tokenizer,
        *,
        eos_id: int | None = None,
        max_queue: int = 64,
        max_tokens: int | None = None,
        adapters=None,
        max_num_batched_tokens: int | None = None,
    ):
        """max_tokens: the most new tokens one sequence may ask for (None: the window's limit);
        adapters: the AdapterPool (serve/adapters.py) whose slots the sequences' adapters decode in;
        max_num_batched_tokens: the tokens one turn runs while slots decode (a token per decoding row,
        the rest prefill chunks; default: 2048 prompt tokens, at least one prefill_chunk, + its slots)."""
        self.engine, self.tokenizer, self.eos_id, self.max_queue = engine, tokenizer, eos_id, max_queue
        self.max_tokens, self.adapters = max_tokens, adapters
        # several prompts a turn: one chunk a turn cost a burst a decode step per prompt (TTFT p99 0.86x)
        self.max_num_batched_tokens = max_num_batched_tokens or max(2048, engine.prefill_chunk) + engine.slots
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.pending: collections.deque[Sequence] = collections.deque()
        self.active: dict[int, Sequence] = {}  # slot -> sequence (prefilling or decoding)
        self.prefilling: dict[int, object] = {}  # slot -> its PrefillJob (None: not started), oldest first
        self.plan: dict[int, int] = {}  # this turn's mixed step: held slot -> its prompt's last tokens
        self.metrics = None  # a ServeMetrics (flaxgpt/serve/metrics.py) once an app serves us
        self.lock, self.ready, self.accepting = threading.Condition(), threading.Event(), True
        self.stats = collections.Counter()  # finished, cancelled, failed, rejected sequences
        self._closed = False
        self.thread = threading.Thread(target=self._main, name="flaxgpt-engine", daemon=True)

    # ------------------------------------------------------------ any thread

    def start(self):
        self.thread.start()

    def submit(self, *seqs: Sequence) -> None:
        """Queue sequences (all or none): Draining while shutting down, QueueFull past the bound."""
        with self.lock:
            if not self.accepting:
                raise Draining("the server is shutting down")
            over = [s for s in seqs if self.max_tokens and int(s.rows.max_new_B[0]) > self.max_tokens]
            if over:
                raise TooManyTokens(
                    f"max_tokens is {int(over[0].rows.max_new_B[0])}; this server generates at most "
                    f"{self.max_tokens} tokens per completion: ask for fewer"
                )
            if len(seqs) > self.engine.slots + self.max_queue:
                raise TooManySequences(
                    f"this request asks for {len(seqs)} sequences (prompts x n); the server takes at most "
                    f"{self.engine.slots + self.max_queue} at once (its slots + max_queue): send fewer"
                )
            free = self.engine.slots - len(self.active)
            self._drop_cancelled()  # clients gone while queued hold no place (they made new ones 429)
            if len(self.pending) + len(seqs) > self.max_queue + free:
                self._count("rejected", len(seqs))
                raise QueueFull(retry_after=1 + len(self.pending) // self.engine.slots)
            now = time.perf_counter()
            for s in seqs:
                s.submitted = now
            self.pending.extend(seqs)
            self.lock.notify()

    @property
    def busy(self) -> int:
        with self.lock:
            return len(self.pending) + len(self.active)

    def drain(self, timeout: float | None = None) -> bool:
        """Refuse new sequences and wait until the queued and running ones finish."""
        with self.lock:
            self.accepting = False
            return self.lock.wait_for(lambda: not self.pending and not self.active, timeout)

    def close(self):
        with self.lock:
            self._closed = True
            self.lock.notify_all()
        # warming up, it stops after the program it compiles: a process leaving XLA mid-compile aborts
        self.thread.join(timeout=10 if self.ready.is_set() else None)

    # ------------------------------------------------------------ the engine thread

    def _main(self):
        try:
            self._warm_up()
        except _Closed:  # closed while compiling (SIGTERM at start-up)
            return
        except Exception:
            log.error("engine warm-up failed:\n%s", traceback.format_exc())
            raise
        self.ready.set()
        while True:
            with self.lock:
                self.lock.wait_for(lambda: self._closed or self.pending or self.active)
                if self._closed:
                    return
            self._admit()
            if len(self.active) > len(self.prefilling):  # some slot decodes
                self._step()
            with self.lock:
                self.lock.notify_all()  # drain() waits on the same condition

    def _warm_up(self):
        """Compile every program now, so no request waits for XLA: a prefill per bucket, insert, generate
        for one step and for `chunk`."""
        rows = Rows.of(Sampling(temperature=1.0, top_k=1), max_new_tokens=2)
        for i, b in enumerate(self.engine.buckets):
            # prompts that differ in their first token: none reuses another's blocks, each runs its bucket
            prefix = self.engine.prefill([i] + [0] * (min(b, self.engine.max_len - 2) - 1), rows)
            self.engine.insert(prefix, 0)  # each in turn: the slot's previous pages go back
            self._stop_if_closed()
        for w in self.engine.mixed_widths:  # the mixed step's hold and each width
            self.engine.blocks.clear()  # no warm-up prompt reuses another's blocks: each runs its width
            self.engine.hold(self.engine.start_prefill([1] * w, rows), 0)
            self.engine.mixed({0: w})
            self._stop_if_closed()
        self.engine.generate(steps=1)
        self._stop_if_closed()
        any_token_BW = np.full((self.engine.slots, self.engine.mask_words), -1, np.int32)
        self.engine.generate(steps=1, mask_BW=any_token_BW)  # the structured-output step
        if self.engine.speculate_k:
            B, K = self.engine.slots, self.engine.speculate_k
            self.engine.speculate(np.zeros((B, K), np.int32), np.zeros(B, np.int32))
            if self.engine.draft is not None:
                self.engine.speculate_with_draft(np.zeros(B, bool))
        self.engine.release(0)
        self.engine.generate()
        self.engine.blocks.clear()  # the warm-up prompts' blocks: no request has them

    def _stop_if_closed(self):
        if self._closed:
            raise _Closed

    def _count(self, outcome: str, n: int = 1):
        self.stats[outcome] += n
        if self.metrics is not None:
            self.metrics.sequences.labels(outcome=outcome).inc(n)

    def _admit(self):
        """Start waiting sequences in free slots, then run prefill chunks (see the module docstring)."""
        while True:
            with self.lock:
                free = [s for s in range(self.engine.slots) if s not in self.active]
                if not free or not self.pending:
                    break
                seq = self._take_pending()
                if seq is None:  # every waiting sequence's adapter waits for a slot
                    break
                self.active[free[0]] = seq  # reserved before the prefill: submit counts it busy
                self.prefilling[free[0]] = None  # started when its turn comes (below)
        decoding = len(self.active) - len(self.prefilling)
        if decoding:  # this turn's prefill tokens: the budget less one token per decoding row, oldest first
            # (the earliest first token; a later prompt may then reuse the blocks an earlier one cached)
            left = self.max_num_batched_tokens - decoding
            while self.prefilling and left > 0:
                left -= self._prefill_once(next(iter(self.prefilling)), left)
            if left == self.max_num_batched_tokens - decoding and self.prefilling:  # the budget went to
                self._prefill_once(next(iter(self.prefilling)))  # decoding rows: a chunk all the same
        else:  # nobody decodes (a burst): oldest first, each to its end
            while self.prefilling:
                self._prefill_once(next(iter(self.prefilling)))

    def _drop_cancelled(self) -> None:
        """Sequences whose clients went away while queued leave the queue. (Under self.lock.)"""
        live = [seq for seq in self.pending if not seq.cancelled]
        if len(live) < len(self.pending):
            self._count("cancelled", len(self.pending) - len(live))
            self.pending = collections.deque(live)

    def _take_pending(self) -> Sequence | None:
        """The oldest waiting sequence whose adapter is resident or can be swapped in now (its adapter
        slot then held), else None; cancelled sequences are dropped first. (Under self.lock.)"""
        self._drop_cancelled()
        for seq in list(self.pending):
            try:
                slot = 0 if seq.adapter is None else self.adapters.acquire(seq.adapter)
            except Exception as e:  # a failed device write: this sequence fails, the others go on
                self.pending.remove(seq)
                self._fail(None, seq, e)
                continue
            if slot is not None:
                self.pending.remove(seq)
                seq.adapter_slot = slot
                return seq
        return None

    def _prefill_once(self, slot: int, tokens: int | None = None) -> int:
        """One prefill chunk (at most `tokens`) of the sequence in `slot`; its first token once the prompt
        is in. -> prompt tokens run (a cancelled or failed sequence: all it had left, so the turn goes on)."""
        job, seq = self.prefilling[slot], self.active[slot]
        if seq.cancelled:  # a client gone mid-prefill: its pages go back now
            del self.prefilling[slot]
            if job is not None:
                self.engine.cancel(job)
            self._free(slot, release=False)
            self._count("cancelled")
            return 0
        try:
            if job is None:  # matched against the prefix cache only now: a burst of prompts with one
                # system prompt reuses the blocks the first of them just cached (then mixed if short)
                salt = b"" if seq.adapter is None else seq.adapter.key
                mask = None
                if seq.grammar is not None:
                    mask = np.full((1, self.engine.mask_words), -1, np.int32)
                    seq.grammar.fill(mask, 0)
                    mask = mask[0]
                job = self.engine.start_prefill(
                    seq.prompt_ids, seq.rows, adapter=seq.adapter_slot, salt=salt, mask=mask, echo=seq.echo
                )
                self.prefilling[slot] = job
                if self.metrics is not None:
                    self.metrics.admitted(len(seq.prompt_ids), job.hit)
            if self._mixes(seq, job, tokens):  # its slot held, its prompt's rest in this turn's step
                self.engine.hold(job, slot)
                del self.prefilling[slot]
                self.plan[slot] = job.left
                return job.left
            before = job.done_upto
            prefix = self.engine.prefill_step(job, tokens)
            ran = job.done_upto - before
            if prefix is None:
                return ran
            del self.prefilling[slot]
            first, done = int(prefix.first), bool(prefix.done)
            if done:  # its first token ended it: never in a slot
                self.engine.drop(prefix)
            else:
                self.engine.insert(prefix, slot)
            lps = None
            if seq.logprobs is not None:
                lps = [TokenLogprob.of(seq.logprobs, first, *(np.asarray(x) for x in prefix.logprobs))]
            if seq.echo:
                self._echo(seq, job)
        except Exception as e:  # a poisoned request: it fails (a 500), its pages go back, the rest go on
            self.prefilling.pop(slot, None)
            if job is not None:
                self.engine.cancel(job)
            self._fail(slot, seq, e)
            return 0
        self._advance(slot, seq, [first], done, lps)
        return ran

    def _mixes(self, seq: Sequence, job, tokens: int | None) -> bool:
        """The rest of its prompt runs in the next step beside the decoding rows (Engine.mixed): on
        where the engine has the mixed step, the rest fits its widest width and the budget, and no
        sequence this turn needs what only the two programs do (a grammar's mask, echo, drafts)."""
        widths = self.engine.mixed_widths
        if not widths or self.engine.speculate_k or seq.echo or job.left > widths[-1]:
            return False
        return job.left <= (tokens or job.left) and all(s.grammar is None for s in self.active.values())

    def _echo(self, seq: Sequence, job):
        """The prompt's tokens with their logprobs (the first has none), emitted before any text."""
        parts = [np.concatenate(x) for x in zip(*job.echoed)]  # each position's next token's, [n] ...
        prompt = [TokenLogprob(seq.prompt_ids[0], None, [])]
        for i, tok in enumerate(seq.prompt_ids[1:]):
            prompt.append(TokenLogprob.of(seq.logprobs, tok, parts[0][i], parts[1][i], parts[2][i]))
        seq.emit(Delta("", [], prompt))

    def _step(self):
        with self.lock:
            active = {slot: seq for slot, seq in self.active.items() if slot not in self.prefilling}
        for slot, seq in active.items():
            if seq.cancelled:
                self._free(slot, release=True)  # a held slot's pages too (the engine forgets it)
                self._count("cancelled")
        plan, self.plan = {s: n for s, n in self.plan.items() if s in self.engine.held}, {}
        try:
            # prompts still prefilling: one step, then back to their next chunk (their first token
            # waits for one decode step per chunk, not `chunk` steps); a free slot: one step too, so
            # a request arriving now (a chat's next turn) is admitted after one step, not `chunk`
            one = self.prefilling or len(self.active) < self.engine.slots
            fill = None
            constrained = [(slot, seq) for slot, seq in active.items() if seq.grammar is not None]
            if constrained:  # each token's mask follows the one before: one step at a time, the mask
                # computed while the model runs (Engine.generate calls `fill` after dispatching it)

                def fill():
                    mask_BW = np.full((self.engine.slots, self.engine.mask_words), -1, np.int32)
                    for slot, seq in constrained:
                        if not seq.finished and not seq.cancelled:
                            seq.grammar.fill(mask_BW, slot)
                    return mask_BW

                one = True
            drafts = None if constrained or plan else self._drafts(active)
            if plan:  # held prompts' last tokens beside one decode step (no grammar, no drafts: _mixes)
                tokens_BC, new_B, done_B = self.engine.mixed(plan)
                if self.metrics is not None:
                    self.metrics.mixed_tokens.inc(sum(plan.values()))
            elif drafts is not None:  # speculative: drafted tokens checked in the same model call
                if self.engine.draft is not None:  # drafted by the draft model (n_B: how many it may)
                    tokens_BC, new_B, done_B = self.engine.speculate_with_draft(drafts[1] > 0)
                else:
                    tokens_BC, new_B, done_B = self.engine.speculate(*drafts)
                drafting = drafts[1] > 0
                if self.metrics is not None and drafting.any():
                    kept = np.minimum(np.maximum(new_B - 1, 0), drafts[1])[drafting]
                    self.metrics.speculated(int(drafting.sum()), int(drafts[1].sum()), int(kept.sum()))
            else:
                tokens_BC, new_B, done_B = self.engine.generate(steps=1 if one else None, mask_BW=fill)
            lp = self.engine.logprobs
        except Exception as e:  # not expected: fail the running sequences, keep serving
            for slot, seq in active.items():
                self._fail(slot, seq, e)
            return
        for slot, seq in active.items():
            if not seq.finished and not seq.cancelled:
                ids = tokens_BC[slot, : new_B[slot]].tolist()
                lps = None
                if seq.logprobs is not None:
                    mine = (lp.chosen[slot], lp.top_ids[slot], lp.top[slot])
                    lps = [TokenLogprob.of(seq.logprobs, t, *(x[i] for x in mine)) for i, t in enumerate(ids)]
                self._advance(slot, seq, ids, bool(done_B[slot]), lps)

    def _drafts(self, active: dict):
        """Prompt-lookup drafts (serve/ngram.py) for the greedy rows that may use them -> (drafts_BK,
        n_B), or None when speculation is off or no row drafted (a plain `chunk` step then). With a
        draft model n_B is only how many drafts each row may check (its drafts come from the model)."""
        K = self.engine.speculate_k
        if not K:
            return None
        drafts_BK, n_B = np.zeros((self.engine.slots, K), np.int32), np.zeros(self.engine.slots, np.int32)
        for slot, seq in active.items():
            r = seq.rows
            # drafts are checked against the raw logits' top token: a row whose draws move it (penalties,
            # logit_bias, a grammar) or that reports logprobs takes plain steps
            biased = bool(np.any(np.asarray(r.bias_ids_BL) >= 0))
            plain = seq.logprobs is None and seq.grammar is None and not r.penalized and not biased
            if seq.finished or seq.cancelled or float(r.temperature_B[0]) != 0 or not plain:
                continue
            room = int(r.max_new_B[0]) - len(seq.ids) - 1  # the step's own token comes on top of the drafts
            if self.engine.draft is not None:
                n_B[slot] = max(min(K, room), 0)
                continue
            d = ngram.propose(seq.prompt_ids + seq.ids, min(K, room)) if room > 0 else []
            drafts_BK[slot, : len(d)], n_B[slot] = d, len(d)
        return (drafts_BK, n_B) if n_B.any() else None

    def _advance(self, slot: int, seq: Sequence, new_ids: list[int], device_done: bool, lps=None):
        """Hand `seq` its new tokens: text, stop strings and stop tokens, its grammar, and the end of the
        sequence. lps: each new token's TokenLogprob (requests with logprobs)."""
        try:
            if new_ids and self.metrics is not None:
                now = time.perf_counter()
                first_after = None if seq.ids else now - seq.submitted
                gap = None if seq.last_at is None else now - seq.last_at
                self.metrics.tokens(len(new_ids), first_after, gap)
                seq.last_at = now
            eos_id = int(seq.rows.eos_B[0])
            eos = device_done and eos_id >= 0 and new_ids and new_ids[-1] == eos_id
            ended = False  # a stop token or the grammar's end: the reply ends at that token
            for i, t in enumerate(new_ids):
                if t in seq.stop_ids:
                    new_ids, ended = new_ids[: i + 1], True
                    break
                if seq.grammar is not None and not (eos and i == len(new_ids) - 1):
                    seq.grammar.accept(t)
                    if seq.grammar.done():
                        new_ids, ended = new_ids[: i + 1], True
                        break
            seq.ids.extend(new_ids)
            hidden = eos or (ended and seq.ids[-1] in seq.stop_ids)  # not part of the text
            if seq.detok is None:  # the text that follows the prompt, decoded a few tokens at a time
                tok = WithSpecial(self.tokenizer) if seq.special else self.tokenizer
                seq.detok = Detokenizer(tok, seq.prompt_ids)
            seq.detok.add(new_ids[:-1] if hidden else new_ids)
            if ended or device_done:
                seq.detok.flush()
            text = seq.detok.text
            found = [(i, i + len(s)) for s in seq.stop for i in [text.find(s, max(0, seq.sent - len(s)))]]
            found = [f for f in found if f[0] >= 0]
            if found:
                start, end = min(found)
                text, reason = text[:start], "stop"
                # the reply ends at the token that completes the stop string; a step may have made more
                # (a chunk of tokens, accepted drafts): not counted, not reported, whatever the load
                k = self._tokens_reaching(seq, new_ids, end)
                if k < len(new_ids):
                    del seq.ids[len(seq.ids) - len(new_ids) + k :]
                    new_ids, hidden = new_ids[:k], False
            elif ended:
                reason = "stop"
            elif device_done:
                reason = "stop" if eos else "length"
            else:
                reason, text = None, text[: len(text) - held_back(text, seq.stop)]
            entries = [] if lps is None else lps[: len(new_ids) - hidden]
            if new_ids or len(text) > seq.sent:  # an empty delta too: clients see tokens arrive
                seq.emit(Delta(text[seq.sent :], entries))
                seq.sent = max(seq.sent, len(text))
            if reason:
                seq.finished = True
                self._count("finished")
                if len(seq.ids) > 1 and not seq.echo:  # it decoded in its slot: keep its prompt + reply
                    self.engine.keep(slot, seq.prompt_ids + seq.ids[:-1])  # for the next turn
                # an echo is not kept: its pages go back now, not when a later request needs them
                self._free(slot, release=not device_done or ended or seq.echo)
                seq.emit(Finish(reason, len(seq.ids)))
        except Exception as e:
            self._fail(slot, seq, e)

    def _tokens_reaching(self, seq: Sequence, new_ids: list[int], end: int) -> int:
        """How many of this step's new ids (the last of seq.ids) the reply's text needs to reach `end`
        characters: decoded again from the prompt, once a sequence, when a stop string ends it."""
        detok = Detokenizer(seq.detok.tokenizer, seq.prompt_ids)
        detok.add(seq.ids[: len(seq.ids) - len(new_ids)])
        for k, t in enumerate(new_ids, 1):
            detok.add([t])
            if len(detok.text) >= end:
                return k
        return len(new_ids)

    def _fail(self, slot: int | None, seq: Sequence, e: BaseException):
        log.error("sequence failed: %s", "".join(traceback.format_exception_only(e)).strip())
        seq.finished = True
        self._count("failed")
        if slot is not None:  # None: it never had a slot
            self._free(slot, release=True)
        try:
            seq.emit(Failed(str(e)))
        except Exception:
            pass

    def _free(self, slot: int, release: bool):
        if release:
            self.engine.release(slot)
        with self.lock:
            seq = self.active.pop(slot, None)
        if seq is not None and seq.adapter is not None:  # its adapter's slot may now be swapped or emptied
            self.adapters.release(seq.adapter_slot)
