"""GRPO's asynchronous rollouts (grpo.off_policy_steps = k > 0): the rollout of step n + k is sampled
on a background thread while step n's update runs, so the engine's host loop and the jitted update
overlap instead of taking turns.

    pipeline = Pipeline(rollout, k=1, max_iters=100)   # rollout(params, frozen, step, n_rows, index)
    batch, info = pipeline.take(params, frozen, step, n_rows, process_index)   # waits for step's
    pipeline.before_update(params, step)   # before step's update is dispatched: step + k starts
    out = pipeline.call(fn, *args)   # fn on the rollout thread (the engine is one thread's at a time)

Staleness: step n trains on completions sampled by the weights of state n - k, those update n - k
starts from (`before_update` copies them just before update n - k is dispatched): the batch of step
n is k updates old (k = 0 is the synchronous trainer, which builds no pipeline). The first k steps
of a run (or of a resumed run) have no such weights: they are sampled by the weights the run starts
from (staleness 0, 1, ..., k - 1), so a resumed off-policy run is not bit for bit an uninterrupted
one. The same seeds give the same run: each rollout's inputs (the weights of a fixed step, the
step's prompts and seed) do not depend on how the threads interleave, and one worker runs the
rollouts in step order.

Weights: the train step donates its whole state (parameters and the frozen weights alike), so the
rollout thread may not hold the trainer's arrays: `before_update` takes a device-to-device copy of
the parameters (jax.device_put(may_alias=False): no host round trip; dispatched before the update,
which then waits on the device for the copy's read) and the frozen weights (LoRA's base, the
reference) are copied once. The copy is a second set of the trained parameters (and of the frozen
weights) on the device; aliasing instead would read buffers the next update has given away.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax


def own_copy(tree):
    """A device-side copy of a pytree of arrays that no donation can take away (same placement)."""
    return jax.device_put(tree, may_alias=False)


class Pipeline:
    """Rollouts k steps ahead of the updates, on one worker thread; see the module docstring."""

    def __init__(self, rollout, k: int, max_iters: int):
        if k < 1:
            raise ValueError(f"grpo.off_policy_steps={k}: the pipeline runs k >= 1 steps ahead")
        self.rollout, self.k, self.max_iters = rollout, int(k), int(max_iters)
        self.pending: dict[int, Future] = {}  # step -> its rollout, in flight or done
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="grpo-rollout")
        self.frozen = None  # the engine's copy of the frozen weights, taken once
        self.shape = None  # (n_rows, process_index) of the run's rollouts

    def _submit(self, params, step: int) -> None:
        if step < self.max_iters and step not in self.pending:
            n_rows, index = self.shape
            self.pending[step] = self.worker.submit(self.rollout, params, self.frozen, step, n_rows, index)

    def take(self, params, frozen, step: int, n_rows: int, process_index: int = 0):
        """(batch, info) of `step`, waited for. A step nothing was started for (the run's first, a
        resume's) starts it and the k - 1 after it from `params`."""
        if step not in self.pending:
            if self.frozen is None:
                self.frozen = own_copy(frozen)
            self.shape = (n_rows, process_index)
            start = own_copy(params)
            for m in range(step, step + self.k):
                self._submit(start, m)
        t0 = time.perf_counter()
        batch, info = self.pending.pop(step).result()
        return batch, {**info, "rollout_wait": time.perf_counter() - t0}

    def before_update(self, params, step: int) -> None:
        """Called before update `step` is dispatched (it donates `params`): the rollout of step + k
        starts from a copy of them."""
        self._submit(own_copy(params), step + self.k)

    def call(self, fn, *args):
        """fn(*args) on the rollout thread, after the rollouts already started (evaluations use the
        engine too), waited for."""
        return self.worker.submit(fn, *args).result()
