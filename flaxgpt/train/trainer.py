"""The training loop: set up and check everything, restore or initialise the state, then train with
evaluation, logging and checkpoints.

    summary = train(config)   # config: a configs/*.py recipe -> {"loss", "best_val_loss", "state", ...}

The pure steps it runs (TrainState, the train step with gradient accumulation inside, the eval step)
are flaxgpt.train.steps.make_steps'. Model-specific parts live in the task (flaxgpt.train.tasks.Task:
an objective x a policy x a batch source, chosen by `config.model.kind` and `data.format`): model
config, parameters, loss, batches, frozen weights and extra eval metrics. MFU counts FLOPs with
flaxgpt.models.flops.flops_per_token, the figure `flaxgpt summary` prints.

Checkpoints (flaxgpt.runs.checkpoint) live in out_dir/checkpoints: `Trainer.init_state` restores the
latest one (init_from auto | resume) onto `restore_target`, the loop saves every ckpt_interval steps,
at the end and on SIGTERM. The data position is the step, so a restored state continues exactly.
Each checkpoint records the run config and data meta it was trained with (a resume that changes the
model or the tokenizer is refused: run_dir.check_resume) and the loss of its own weights on a fixed
batch, so the checkpoint named after a NaN is one whose loss was finite and not exploding.
`state.frozen` is train.policy.Frozen(base, reference) (LoRA's base, DPO / GRPO's reference): FSDP-sharded,
never checkpointed; with LoRA (lora.rank > 0) `params` are the adapters.
`train` holds out_dir's lock (flaxgpt.runs.run_lock) from before anything is written until it returns.
An `online` task (GRPO, flaxgpt.train.grpo_online) samples each step's batch from the weights the
previous step made (`train_batch`), reusing one rollout for grpo.num_iterations steps; its rollout's
metrics and the update's own time are logged with the step.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np

from flaxgpt import cluster, runtime, sharding
from flaxgpt.data import batches as data_lib
from flaxgpt.models import attention, gpt, linear
from flaxgpt.models import registry as models
from flaxgpt.models.flops import flops_per_token
from flaxgpt.runs import checkpoint as ckpt_lib
from flaxgpt.runs import checksum, run_dir, run_lock
from flaxgpt.runs.metrics import MetricsWriter, closing_lines, peak_flops_per_device
from flaxgpt.train import sections
from flaxgpt.train.config_check import check as check_config
from flaxgpt.train.config_check import micro_batch, schedule_note
from flaxgpt.train.preemption import StopSignal
from flaxgpt.train.steps import TrainState, make_steps, make_train_step  # noqa: F401 (re-exported)
from flaxgpt.train.tasks import make_task


def start_process(config) -> None:
    """What the process settles before JAX starts its backends: the multi-host handshake, the CPU's
    split into devices, and (on one CPU device) steps that reuse their memory."""
    cluster.join(config.distributed)  # Slurm, Open MPI, SkyPilot, a GKE JobSet, a TPU pod, or the settings
    mesh = sections.of(config).mesh
    sharding.configure_cpu_devices(mesh.cpu_devices, micro_batch(config), mesh.context)
    runtime.keep_cpu_step_memory()


class Trainer:
    """Everything set up and checked before anything is written; then `run`."""

    def __init__(self, config, devices=None, print_fn=print):
        self.config, self.print = config, print_fn
        self.micro_rows = micro_batch(config)
        self.task = make_task(config)
        # a run it starts from (LoRA's frozen base, DPO / GRPO references): the step read, recorded
        # with each checkpoint, so the run's weights always mean that base (its latest may move on)
        self.init_step = (
            run_dir.checkpoint_step(config.init_from) if run_dir.is_run_dir(config.init_from) else None
        )
        m = sections.of(config).mesh
        devices = self.task.devices(devices)  # GRPO's engine may keep devices of its own
        self.mesh = sharding.make_mesh(m.data, m.fsdp, devices, expert=m.expert, context=m.context)
        attention.check_context_mesh(self.task.kind, self.task.model_config, self.mesh)
        sharding.check_batch(self.micro_rows, self.mesh, "batch_size // grad_accum")
        sharding.check_context_in_processes(self.mesh)
        if self.micro_rows % jax.process_count():
            raise ValueError(
                f"batch_size // grad_accum = {self.micro_rows} is not divisible by the "
                f"{jax.process_count()} processes"
            )
        steps = make_steps(config, self.task, self.mesh)
        self.tx, self.schedule, self._init_state_fn = steps.tx, steps.schedule, steps.init_state
        self.param_shardings, self.state_shardings = steps.param_shardings, steps.state_shardings
        self.abstract_state = steps.abstract_state
        self.train_batch_sharding = steps.train_batch_sharding
        self.eval_batch_sharding = steps.eval_batch_sharding
        self.train_step, self.eval_step = steps.train_step, steps.eval_step
        self.frozen = steps.frozen
        self.online = self.task.online  # GRPO: batches sampled from the weights
        self.batch_info, self._rollout = {}, None  # the last batch's metrics; an online task's batch
        self.tokens_per_step = config.batch_size * self.task.tokens_per_row
        # training FLOPs per token, the figure `flaxgpt summary` prints (for MFU)
        self.flops_per_token = flops_per_token(self.task.model_config, self.task.tokens_per_row)["train"]
        self.is_main = jax.process_index() == 0
        # restore onto the state's shardings: any mesh / device count, whatever the saving run had
        self.restore_target = sharding.shapes_on(self.abstract_state, self.state_shardings)
        # last: only a checked config gets a checkpoints directory (every process writes its own shards)
        if config.init_from == "resume" and not (Path(config.out_dir) / "checkpoints").is_dir():
            raise ckpt_lib.CheckpointError(
                f"init_from=resume but {config.out_dir} has no checkpoint; "
                "use init_from=scratch or point out_dir at a run with checkpoints"
            )
        self.data_meta = run_dir.check_data(config.out_dir, self.task.data_dir)  # another vocabulary: refused
        self.task_eval = self._task_evaluator()  # its files are read (and checked) before anything is written
        self.ckpt = ckpt_lib.Checkpointer(config.out_dir, keep=config.keep_checkpoints, keep_best=True)
        self.resumed_best = float("inf")  # best val loss of the restored run's checkpoints
        self.best_loss = float("inf")  # lowest loss seen (train, eval, checkpoints'): what "exploding" means

    def _task_evaluator(self):
        """config.eval_tasks (HellaSwag, LAMBADA, perplexity files) -> eval_tasks.TrainingEvaluator."""
        c = self.config
        if not c.get("eval_tasks"):
            return None
        if models.kind_of(self.task.model_config) != "gpt" or jax.process_count() > 1:
            raise ValueError(
                f"eval_tasks {c.eval_tasks!r} needs a GPT run on one process; this run is "
                f"{models.kind_of(self.task.model_config)!r} on {jax.process_count()} processes"
            )
        from flaxgpt.data import tokenizers
        from flaxgpt.eval import tasks as eval_tasks

        tokenizer = tokenizers.from_meta(self.data_meta["tokenizer"])
        devices = list(self.mesh.devices.flat)
        return eval_tasks.TrainingEvaluator(
            c.eval_tasks, self.task.model_config, tokenizer, limit=c.eval_tasks_limit, devices=devices
        )

    def _check_init_step(self, extra: dict, step: int) -> None:
        """A resume whose frozen weights (LoRA's base, a reference) come from init_from's run must read
        the step the checkpoint was trained on: refused, naming it, when that run has moved on."""
        was, frozen = extra.get("init_step"), self.frozen is not None or sections.of(self.config).lora.rank
        if frozen and was is not None and self.init_step != was:
            raise run_dir.RunError(
                f"checkpoint step {step} was trained on init_from's step {was}, and {self.config.init_from} "
                f"is at step {self.init_step} now: move its checkpoints past step {was} away to resume, "
                "or use a new out_dir"
            )

    def init_state(self) -> TrainState:
        """The latest checkpoint (init_from auto | resume, or a fine-tune's own checkpoints), else a
        fresh state built directly in its shardings (never whole on one device), or the task's
        pretrained parameters."""
        step = run_dir.resume_step(self.ckpt, self.config.init_from)  # a fine-tune: its own checkpoints
        self.best_loss = float("inf")
        if step is not None:
            extra = self.ckpt.restore_extra(step)
            self._check_init_step(extra, step)
            cfg = self.config.to_dict()
            changed = run_dir.check_resume(extra, step, self.task.model_config, self.data_meta, cfg)
            mesh, was = dict(self.mesh.shape), extra.get("mesh")
            if was is not None and was != mesh:  # other reductions: the same run, not the same bits
                changed.append(f"mesh: {was} -> {mesh} (not bit-identical to going on where it was saved)")
            if changed:
                self._print(
                    f"resuming step {step} with changed settings (recorded with each new checkpoint): "
                    + "; ".join(changed)
                )
            self.best_loss = min(
                self.best_loss, _finite_or_inf(extra.get("best_loss")), _finite_or_inf(extra.get("loss"))
            )
            state, _ = self.ckpt.restore(step, abstract_state=self.restore_target)
            best = self.ckpt.best_step()
            if best is not None:
                val = self.ckpt.restore_extra(best).get("val_loss")
                self.resumed_best = float("inf") if val is None else float(val)
            self.task.pretrained = None  # not needed: the checkpoint holds the fine-tuned weights
            self._print(f"resumed from {self.ckpt.directory / str(step)}")
            return state.replace(frozen=self.frozen)
        key = jax.random.key(self.config.seed)
        pretrained = self.task.pretrained
        if pretrained is not None:  # parameters as arguments, not constants baked into the program
            params = jax.device_put(pretrained, self.param_shardings)
            make = jax.jit(self._init_state_fn, out_shardings=self.state_shardings)
            return make(key, params).replace(frozen=self.frozen)
        if not hasattr(self, "_init_jit"):
            self._init_jit = jax.jit(self._init_state_fn, out_shardings=self.state_shardings)
        return self._init_jit(key).replace(frozen=self.frozen)

    def _print(self, msg: str) -> None:
        if self.is_main:
            self.print(msg)

    def global_batch(self, split: str, step: int, rows: int, micro: bool):
        local = self.task.batch(split, step, rows // jax.process_count(), jax.process_index())
        if micro:
            local = data_lib.split_micro(local, self.config.grad_accum)
            return data_lib.to_global(local, self.train_batch_sharding, batch_axis=1)
        return data_lib.to_global(local, self.eval_batch_sharding)

    def train_batch(self, step: int, state: TrainState):
        """Step `step`'s batch: the task's data, or (online) completions sampled from `state`'s
        weights, one rollout every num_iterations steps (and on the first step of a run)."""
        if not self.online:
            return self.global_batch("train", step, self.config.batch_size, micro=True)
        if self._rollout is not None and step % self.task.num_iterations:
            self.batch_info = {**self.batch_info, "rollout_time": 0.0}  # the same completions again
            return self._rollout
        n = self.config.batch_size // jax.process_count()
        local, self.batch_info = self.task.rollout(state.params, state.frozen, step, n, jax.process_index())
        local = data_lib.split_micro(local, self.config.grad_accum)
        self._rollout = data_lib.to_global(local, self.train_batch_sharding, batch_axis=1)
        return self._rollout

    def evaluate(self, params, frozen) -> dict:
        """Mean loss over eval_iters fixed batches of each split (results fetched once at the end)."""
        sums = {}
        for split in self.task.splits:
            name = "train_eval" if split == "train" else split
            parts = [
                self.eval_step(params, self.global_batch(name, i, self.micro_rows, micro=False), frozen)
                for i in range(self.config.eval_iters)
            ]
            sums[split] = parts
        fetched = jax.device_get(sums)
        out = {f"{s}_loss": float(sum(p[0] for p in v) / sum(p[1] for p in v)) for s, v in fetched.items()}
        # the task's own metrics (seq2seq: accuracy, BLEU; GRPO: held-out rewards, sampled with LoRA's base)
        out.update(self.task.evaluate(params, frozen))
        return out

    def write_run_files(self) -> Path | None:
        if self.is_main:
            cfg = {**self.config.to_dict(), "model": self.task.model_config}
            return run_dir.write_run_files(self.config.out_dir, cfg, self.task.data_dir, self.data_meta)
        return None

    def save(self, step: int, state: TrainState, val_loss=None) -> None:
        """Starts an async save; non-finite weights stop the run instead of replacing a good checkpoint.

        Records the config and data meta trained with, and `loss`: the weights' own loss on a fixed
        batch (one forward pass; a train step's loss is that of the weights before its update), with
        `best_loss`, the lowest loss seen before it."""
        if not checksum.all_finite(state.params):
            raise FloatingPointError(
                f"non-finite weights at step {step} (not saved); {self.last_good()}; "
                "lower the learning rate and resume"
            )
        batch = self.global_batch("train_eval", 0, self.micro_rows, micro=False)
        loss_sum, weight = jax.device_get(self.eval_step(state.params, batch, state.frozen))
        loss = float(loss_sum / weight)
        if not self.online and not np.isfinite(loss):  # resuming would take it, and blow up again
            raise FloatingPointError(
                f"loss is {loss} at step {step} (not saved); {self.last_good()}; "
                "lower the learning rate and resume"
            )
        cfg = self.config.to_dict()
        cfg["model"] = models.section_of(self.task.model_config)
        extra = {
            "data_step": step,
            "config": cfg,
            "meta": self.data_meta,
            "init_step": self.init_step,
            "mesh": dict(self.mesh.shape),
            "loss": loss if np.isfinite(loss) else None,
            "best_loss": self.best_loss if np.isfinite(self.best_loss) else None,
        }
        # an online task's loss (GRPO's) is ~0 and may be negative: no measure of health; finite weights are
        good = self.online or _healthy(extra)
        self.ckpt.save(step, state.replace(frozen=None), extra=extra, val_loss=val_loss, good=good)
        self.best_loss = min(self.best_loss, _finite_or_inf(loss))

    def last_good(self) -> str:
        """Names the newest checkpoint whose recorded loss was finite and not exploding (at most
        `EXPLODING` times the best loss seen before it), for the error that stops a diverged run."""
        self.ckpt.wait()
        steps = self.ckpt.all_steps()
        for step in reversed(steps):
            try:
                extra = self.ckpt.restore_extra(step)
            except ckpt_lib.CheckpointError:
                continue
            if _healthy(extra):
                good = f"the last good checkpoint is {self.ckpt.directory / str(step)}"
                later = [str(self.ckpt.directory / str(s)) for s in steps if s > step]
                # a resume takes the latest checkpoint: a diverged one after the good one would come back
                return good + (f" (move {', '.join(later)} away first)" if later else "")
        if steps:
            where = self.ckpt.directory
            return (
                f"no checkpoint in {where} was saved before the loss blew up (start again in a new out_dir)"
            )
        return "no checkpoint was saved before the loss blew up (run again: it starts afresh)"

    def after_step(self, step: int, state: TrainState) -> None:
        """Hook after each dispatched step (`step` updates done), for tests and tools."""

    def compile(self, state: TrainState, batch) -> float:
        """Compile the train step ahead of time (once per Trainer); returns the seconds it took."""
        if isinstance(self.train_step, jax.stages.Compiled):
            return 0.0
        t0 = time.perf_counter()
        self.train_step = self.train_step.lower(state, batch).compile()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Waits for the save in flight and releases the checkpointer."""
        self.ckpt.close()

    def run(self, state: TrainState, stop: StopSignal | None = None) -> dict:
        """Trains from `state` to max_iters; `stop`: the SIGTERM handler `train` installed before setup
        (else one from here on)."""
        c = self.config
        start, t0 = int(jax.device_get(state.step)), time.perf_counter()
        writer = MetricsWriter(
            c.out_dir,
            c.tensorboard,
            self.is_main,
            self.print,
            total_steps=c.max_iters,
            start_step=start,
            reevaluate=bool(c.get("eval_only")),
        )
        peak = peak_flops_per_device(c.peak_flops)
        flops_per_step = self.flops_per_token * self.tokens_per_step
        self._print(
            f"{gpt.count_params(state.params):,} parameters | {self.tokens_per_step:,} tokens/step | "
            f"mesh {dict(self.mesh.shape)} | "
            + (
                f"MFU vs {peak:.3g} FLOP/s per device"
                if peak
                else f"MFU n/a (no known peak on {jax.devices()[0].platform}; set --config.peak_flops)"
            )
        )
        summary = {"best_val_loss": self.resumed_best, "compile_time": 0.0}

        def log(step, metrics, clock):
            """Blocks until step `step` is done, then writes its metrics timed over exactly the steps
            since `clock` = (time, step) was taken (when the previous log's step was done, or after an
            evaluation or save): the clock never assumes that dispatching a step returns before it runs."""
            m = jax.device_get(metrics)
            now = time.perf_counter()
            dt = (now - clock[0]) / max(1, step - clock[1])
            m.update(
                step_time=dt,
                tokens_per_sec=self.tokens_per_step / dt,
                mfu=flops_per_step / dt / (peak * jax.device_count()) if peak else None,
            )
            writer.write(step, m)
            summary["loss"] = float(m["loss"])
            if not np.isfinite(m["loss"]):
                raise FloatingPointError(
                    f"loss is {m['loss']} at step {step}; {self.last_good()}; "
                    "lower the learning rate and resume"
                )
            self.best_loss = min(self.best_loss, summary["loss"])
            return time.perf_counter(), step  # writing the line is not the next step's time

        # SIGTERM from here on: finish the step, save, return (processes agree every log_interval steps)
        stop = stop or StopSignal(every=c.log_interval)
        try:
            if stop.requested(0):  # during setup (a restore, a compile): nothing trained to save
                self._print(f"{stop.received or 'stop'} during setup: nothing trained; run the same command")
                summary["state"] = state
                return summary
            batch = self.train_batch(start, state) if start < c.max_iters else None
            if start >= c.max_iters and not c.eval_only:
                self._print(f"{c.out_dir} is at step {start}: raise --config.max_iters to train further")
            if start < c.max_iters:
                summary["compile_time"] = self.compile(state, batch)
                self._print(f"compiled the train step in {summary['compile_time']:.1f} s")
            state = self._loop(state, start, batch, writer, summary, log, stop)
        finally:
            try:  # still under SIGTERM's handler: a preemption notice now does not cut the save short
                self.ckpt.wait()  # the save in flight is complete: the last good checkpoint restores
            finally:
                stop.close()
                writer.close()
        summary["state"] = state
        end, latest = int(jax.device_get(state.step)), self.ckpt.latest_step()
        if end > start:  # the closing summary: steps, time, best val loss, checkpoint, how to sample
            where = None if latest is None else self.ckpt.directory / str(latest)
            for line in closing_lines(
                end - start, time.perf_counter() - t0, summary["best_val_loss"], where, c.out_dir
            ):
                self._print(line)
        return summary

    def _eval(self, step, state, writer, summary) -> dict:
        evals = self.evaluate(state.params, state.frozen)
        every = self.config.get("eval_tasks_every") or self.config.eval_interval
        if self.task_eval is not None and (step % every == 0 or step == self.config.max_iters):
            evals.update(self.task_eval(state.params))
        summary["best_val_loss"] = min(summary["best_val_loss"], evals.get("val_loss", np.inf))
        losses = [v for k, v in evals.items() if k.endswith("_loss")]
        self.best_loss = min([self.best_loss] + [_finite_or_inf(v) for v in losses])
        summary.update(evals)
        writer.write(step, {**evals, "best_val_loss": summary["best_val_loss"]})
        if self.is_main and self.config.get("plot", False) and not getattr(self, "_no_plot", False):
            try:
                from flaxgpt.runs.plot import plot_metrics

                plot_metrics(self.config.out_dir)
            except ImportError as e:  # matplotlib is optional: say so once, keep training
                self._no_plot = True
                self.print(f"no metrics.png: {e}")
        return evals

    def _loop(self, state, start, batch, writer, summary, log, stop):
        """Steps start..max_iters with evaluations, saves and logs between them.

        Timing: a logged step is waited for before the next one is dispatched, so each logged figure
        spans exactly the steps it reports. (It used to be read after the next dispatch, which is right
        only while a dispatch returns at once; on a GPU a step of thousands of kernels fills the
        launch queue and its dispatch returns near the step's end, so every figure described the step
        after it and the last one only a tail: 113% MFU.) Between logs, step N-1 is waited for after
        step N is dispatched and the next batch is built while a step runs."""
        c = self.config
        previous, clock = None, (time.perf_counter(), start)
        # eval_only evaluates the checkpoint's own step, also one past max_iters (then the loop ends)
        last = max(c.max_iters, start) if c.eval_only else c.max_iters
        for step in range(start, last + 1):  # here `step` updates are done (maybe in flight)
            evals = {}
            resumed_here = step == start > 0 and not c.eval_only  # the run that saved it evaluated
            if (step % c.eval_interval == 0 or step == c.max_iters or c.eval_only) and not resumed_here:
                evals = self._eval(step, state, writer, summary)
                clock = (time.perf_counter(), step)
            if step > start and ((c.ckpt_interval and step % c.ckpt_interval == 0) or step == c.max_iters):
                self.save(step, state, evals.get("val_loss"))
                clock = (time.perf_counter(), step)  # a save is not a training step's time
            if step > start and stop.requested(step):  # preemption: save this finished step, exit 0
                self.save(step, state)
                self._print(
                    f"{stop.received or 'stop'}: saved step {step} to {self.ckpt.directory}; "
                    "run the same command to resume"
                )
                break
            if step == c.max_iters or c.eval_only:
                break
            t0 = time.perf_counter()
            if self.online:  # off-policy GRPO: a later step's rollout starts from these weights
                self.task.before_update(state.params, step)
            state, metrics = self.train_step(state, batch)  # dispatched; runs while we go on
            if self.online:  # the next batch needs this step's weights (off-policy: sampled meanwhile)
                jax.block_until_ready(metrics)
                metrics = {**metrics, **self.batch_info, "update_time": time.perf_counter() - t0}
            elif step + 1 < c.max_iters:  # the next step's batch, built while this one runs
                batch = self.global_batch("train", step + 1, c.batch_size, micro=True)
            if (step + 1) % c.log_interval == 0:
                clock, previous = log(step + 1, metrics, clock), None
            else:
                # wait for step N-1 while step N runs: at most two steps in flight (a deep queue of
                # steps that all-reduce across CPU devices can starve the host's thread pool)
                jax.block_until_ready(previous)
                previous = metrics["loss"]
            # sampled from the weights this step made; not when stopping: the save comes next (a whole
            # rollout, waited for, once delayed it past a preemption's notice)
            if self.online and step + 1 < c.max_iters and not stop.requested(step + 1):
                batch = self.train_batch(step + 1, state)
            self.after_step(step + 1, state)
        return state


def _finite_or_inf(x) -> float:
    return float(x) if x is not None and np.isfinite(x) else float("inf")


EXPLODING = 2.0  # a checkpoint whose loss is above EXPLODING x the best loss before it is not "good"


def _healthy(extra: dict) -> bool:
    """A checkpoint's recorded loss was finite and at most EXPLODING x the best seen before it
    (checkpoints saved before losses were recorded count as good: their weights were finite)."""
    if "loss" not in extra:
        return True
    loss, best = extra["loss"], _finite_or_inf(extra.get("best_loss"))
    return loss is not None and np.isfinite(loss) and loss <= EXPLODING * best


def train(config, devices=None, print_fn=print) -> dict:
    """Set up (all input checked), write the run files, train; returns the last metrics and state.
    Holds out_dir's lock throughout: a second run on it stops before deleting or writing anything."""
    recorded = run_dir.recorded_init_from(config.out_dir) if config.get("init_from") == "resume" else None
    if recorded not in (None, *run_dir.FRESH_STARTS):  # a fine-tune (LoRA, DPO, GRPO) continues from the
        config.init_from = recorded  # weights it recorded: LoRA's base, a reference ("resume" names none)
    check_config(config)  # every value, once, before anything is written or compiled
    init_from = config.get("init_from", "auto")
    if init_from not in run_dir.FRESH_STARTS and Path(init_from).exists():  # a path: recorded absolute,
        config.init_from = str(Path(init_from).resolve())  # so the run loads from any directory
    run_dir.check_out_dir(config.out_dir, config.get("init_from", "auto"))
    start_process(config)
    # SIGTERM / SIGINT remembered from the lock on: a preemption notice during setup (minutes of restore
    # and compile) stops the run cleanly, lock released, exit 0 (it killed it and left the lock)
    with run_lock.hold(config.out_dir), StopSignal(every=config.get("log_interval", 1)) as stop:
        trainer = Trainer(config, devices, print_fn)
        note = schedule_note(config, trainer.schedule)  # max_iters cuts the warmup or the decay short
        if note:
            trainer._print(note)
        if config.model.get("fp8"):  # float8 asked of devices without float8 matmuls: the emulation
            with jax.set_mesh(trainer.mesh):
                note = linear.fp8_note()
            if note:
                trainer._print(note)
        try:
            state = trainer.init_state()
            if not config.get("eval_only"):  # an evaluation changes no training setting of the run
                trainer.write_run_files()
            with jax.set_mesh(trainer.mesh):  # lets Pallas attention (TPU) split its kernel per device
                return trainer.run(state, stop)
        finally:
            trainer.close()
