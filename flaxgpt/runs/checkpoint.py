"""Checkpoints: an orbax CheckpointManager in out_dir/checkpoints, restorable onto any mesh.

    ckpt = Checkpointer(out_dir, keep=3, keep_best=True)          # async saves
    ckpt.save(step, state, extra={"data_step": step, "config": cfg_dict}, val_loss=vl, good=True)
    state, extra = ckpt.restore(abstract_state=abstract)          # latest step, onto abstract's shardings
    params = ckpt.restore_params(abstract_params=abstract["params"])
    ckpt.wait(); ckpt.close()                                     # before the process exits
    params = load_for_inference(out_dir)                          # on one local device, e.g. a CPU

On disk: out_dir/checkpoints/<step>/{state, extra, metrics}. `state` is any pytree of arrays (a dict,
a flax struct, optax NamedTuples...), stored as a nested dict named by its key paths (params/h_0/attn/...),
so restore only needs the same names and shapes, never the same Python classes. Typed PRNG keys are
stored as their key_data. `extra` is small JSON (data position, resolved config, val_loss, metadata).

Guarantees: a save is written to `<step>.orbax-checkpoint-tmp` and renamed only when complete, so a
kill -9 at any moment leaves either the old set of checkpoints or the new one; unfinished tmp dirs are
never listed and are cleaned up by the next writer. A finished checkpoint that is later damaged
(truncated or deleted files) is never skipped silently: restore raises a one-line CheckpointError naming
the directory and the previous step (falling back would resume training from an older step and then
fail to save over the damaged step). Existing steps are never overwritten.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as ocp_managers

from flaxgpt.runs import state_tree
from flaxgpt.runs.checksum import inspect

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _quiet_read_only():
    """orbax's "Given directory is read only" warning dropped (absl's logger) while a manager opens."""

    def keep(record) -> bool:
        return not record.getMessage().startswith("Given directory is read only")

    absl_log = logging.getLogger("absl")
    absl_log.addFilter(keep)
    try:
        yield
    finally:
        absl_log.removeFilter(keep)


_PRNG_IMPLS = "_prng_impls"  # reserved key in extra: path -> PRNG impl name of each typed key
_CHECKSUMS = "_checksums"  # reserved key in extra: path -> checksum of the saved array's bits


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, found or restored; the message is one line."""


# ----------------------------------------------------------------------------- helpers


def _local_sharding():
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _abstract_leaf(x):
    """A ShapeDtypeStruct to restore into; typed PRNG keys become their uint32 key_data."""
    sharding = getattr(x, "sharding", None) or _local_sharding()
    if state_tree.is_prng_key(x):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        # a NamedSharding spec covers the leading (key) dims; the trailing key_data dim is replicated
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def _one_line(e: BaseException) -> str:
    """The innermost cause's first line (orbax wraps tensorstore's precise error in vaguer ones),
    without tensorstore's spec dump (`<bound method pybind11_...>`)."""
    while e.__cause__ is not None:  # (not __context__: what was being handled when it failed)
        e = e.__cause__
    text = str(e).strip().splitlines()
    first = text[0].split(" See full TensorStore details")[0] if text else ""
    if "No space left on device" in first or getattr(e, "errno", None) == 28:
        return "no space left on device"
    if "File too large" in first or getattr(e, "errno", None) == 27:
        return "file too large (a file-size limit: ulimit -f, or the file system's)"
    return f"{type(e).__name__}: {first[:300]}"


# ----------------------------------------------------------------------------- the checkpointer


class Checkpointer:
    """Saves and restores (state, extra) under out_dir/checkpoints; keeps the latest `keep` + the best.

    Retention: orbax keeps a step if LatestN(keep) or BestN(n=1 by val_loss) wants it; steps saved
    without a val_loss only live while they are among the latest `keep`. So there are at most keep + 1
    checkpoints, and the best one survives later, worse evals and restarts (val_loss is stored per step).
    With keep_best, the newest step saved with `good=True` is kept too (a diverging run's saves do not
    push the last good checkpoint out): at most keep + 2.
    """

    def __init__(
        self, out_dir, keep: int = 3, keep_best: bool = True, async_save: bool = True, read_only: bool = False
    ):
        if keep < 1:
            raise CheckpointError(f"keep={keep} must be >= 1 (the latest checkpoint is what resume needs)")
        self.out_dir = Path(out_dir)
        # orbax (tensorstore) takes absolute paths only; out_dir is usually relative (out/<run>)
        self.directory = self.out_dir.absolute() / "checkpoints"
        if read_only:
            if not self.directory.is_dir():
                raise CheckpointError(
                    f"{self.out_dir} has no checkpoints directory; "
                    "point out_dir at a training run's output directory"
                )
        else:
            self._check_writable()
        policies = [ocp_managers.LatestN(keep)]
        if keep_best:  # reverse=True sorts by descending val_loss, so the kept "last" one is the lowest
            policies.append(
                ocp_managers.BestN(
                    get_metric_fn=_val_loss, reverse=True, n=1, keep_checkpoints_without_metrics=False
                )
            )
            policies.append(  # the highest step of those saved good=True
                ocp_managers.BestN(get_metric_fn=_good_step, n=1, keep_checkpoints_without_metrics=False)
            )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp_managers.AnyPreservationPolicy(policies),
            best_fn=_val_loss if keep_best else None,  # makes orbax write the per-step metrics file
            best_mode="min",
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only,  # unfinished saves of a killed run
            read_only=read_only,
            create=not read_only,
            **({"save_interval_steps": 0} if read_only else {}),  # what orbax sets itself, with a warning
        )
        handlers = {"state": ocp.PyTreeCheckpointHandler(), "extra": ocp.JsonCheckpointHandler()}
        with _quiet_read_only():  # flaxgpt.load / sample.py read a run: orbax's notice is not news
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def _check_writable(self):
        probe = self.directory / f".write_probe.{jax.process_index()}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise CheckpointError(
                f"cannot write checkpoints to {self.directory} ({e.strerror or e}); pass a writable out_dir"
            ) from None

    # -- listing

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def best_step(self) -> int | None:
        """The step with the lowest val_loss (when none has one: None or a step without one)."""
        return self._manager.best_step()

    # -- saving

    def save(
        self,
        step: int,
        state,
        *,
        extra: dict,
        val_loss: float | None = None,
        good: bool | None = None,
        force: bool = False,
    ) -> bool:
        """Starts an async save of `state` + JSON `extra` at `step`; False if the step was not saved.

        Never overwrites: a step that already exists (or is older than the latest) is skipped.
        Refuses non-finite floats, so NaN weights never replace a good checkpoint. Records a checksum
        of each array's bits in `extra`, which every restore verifies (a flipped bit is named).
        `good`: the caller vouches for these weights (the trainer: finite, not exploding loss); the
        newest good step is kept whatever comes after it.
        """
        step = int(step)
        latest = self.latest_step()
        if latest is not None and step <= latest:
            log.info("checkpoint: step %d not saved, the directory already holds step %d", step, latest)
            return False
        flat, impls = {}, {}
        for name, leaf in state_tree.named_leaves(state):
            if state_tree.is_prng_key(leaf):
                impls[name] = str(jax.random.key_impl(leaf))
                leaf = jax.random.key_data(leaf)
            flat[name] = leaf
        finite, checksums = inspect(flat)
        if not all(finite.values()):
            raise CheckpointError(
                f"refusing to save step {step}: the state has NaN or inf values; "
                f"the last good checkpoint is step {latest}"
            )
        extra = {**extra, "step": step, "val_loss": val_loss, _PRNG_IMPLS: impls, _CHECKSUMS: checksums}
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint extra must be JSON: {_one_line(e)}") from None
        metrics = {}
        if val_loss is not None and math.isfinite(val_loss):
            metrics["val_loss"] = float(val_loss)
        if good is not None:
            metrics["good_step"] = step if good else -1
        args = ocp.args.Composite(
            state=ocp.args.PyTreeSave(state_tree.nest(flat)), extra=ocp.args.JsonSave(extra)
        )
        try:
            return self._manager.save(step, args=args, metrics=metrics or None, force=force)
        except (OSError, ValueError) as e:  # (the previous save's failure shows here, or in wait)
            raise self._save_failed(e) from None

    def wait(self):
        """Blocks until the async save in flight (if any) is on disk."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # tensorstore reports a full disk as a ValueError
            raise self._save_failed(e) from None

    def _save_failed(self, e: BaseException) -> CheckpointError:
        why = _one_line(e)
        fix = "free disk space and run" if why == "no space left on device" else "run"
        # the latest step on disk (orbax lists a failed save's step until it is cleaned up)
        steps = sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())
        return CheckpointError(
            f"saving to {self.directory} failed: {why}; {fix} the same command to resume "
            f"from step {steps[-1] if steps else '0 (none saved)'}"
        )

    def close(self):
        try:
            self.wait()
        finally:
            # orbax's close() does not wait for its start-up cleanup of unfinished saves; a process
            # that exits right after (a one-line error) would otherwise print its thread's traceback
            getattr(self._manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()
            try:
                self._manager.close()
            except Exception:  # a failed save was reported by wait(); close only releases threads
                pass

    # -- restoring

    def _resolve_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(
                f"{self.out_dir} has no checkpoint yet (a run saves one every ckpt_interval steps and at "
                "its end); train it further, or point out_dir at a run with checkpoints"
            )
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(f"{self.out_dir} has no checkpoint for step {step}; it has steps {steps}")
        return step

    def _corrupt(self, step: int, e: BaseException) -> CheckpointError:
        """Damaged files (or another reason orbax cannot read a step): name it and the step before it."""
        where = self.directory / str(step)
        if not where.exists():  # removed while read: a training run's retention (keep_checkpoints)
            return CheckpointError(
                f"checkpoint {where} was removed while it was read (a training run on it keeps only its "
                "latest keep_checkpoints); run the command again to read the newest one"
            )
        older = [s for s in self.all_steps() if s < step]
        fix = (
            f"if its files are damaged, move {where} away to resume from step {older[-1]}"
            if older
            else "if its files are damaged, start again in a new out_dir"
        )
        return CheckpointError(f"checkpoint {where} cannot be read ({_one_line(e)}); {fix}")

    def saved_shapes(self, step: int) -> dict[str, tuple[tuple, np.dtype]]:
        """{"params/wte/embedding": (shape, dtype), ...} of a saved state, from its metadata only."""
        try:
            tree = self._manager.item_metadata(step)["state"]
            tree = getattr(tree, "tree", tree)
            return {k: (tuple(m.shape), np.dtype(m.dtype)) for k, m in state_tree.flatten_dict(tree).items()}
        except CheckpointError:
            raise
        except Exception as e:  # orbax raises many types for missing / damaged metadata
            raise self._corrupt(step, e) from None

    def _check_fits(self, step, saved, wanted, check_dtype: bool):
        """One-line errors naming the first entry whose name, shape (or dtype) differs."""
        fix = "resume with the config it was trained with or use a new out_dir"
        # parameters first: a model-config mismatch then names params/..., not its optimizer moments
        for name, (shape, dtype) in sorted(wanted.items(), key=lambda kv: not kv[0].startswith("params/")):
            if name not in saved:
                raise CheckpointError(
                    f"checkpoint step {step} has no {name}: it was saved with a different "
                    f"model or optimizer config; {fix}"
                )
            if saved[name][0] != shape:
                raise CheckpointError(
                    f"checkpoint step {step} does not fit the model: {name} has shape "
                    f"{saved[name][0]} in the checkpoint but {shape} in the config; {fix}"
                )
            if check_dtype and saved[name][1] != dtype:
                raise CheckpointError(
                    f"checkpoint step {step} does not fit the model: {name} has dtype "
                    f"{saved[name][1]} in the checkpoint but {dtype} in the config; {fix}"
                )
        unexpected = sorted(set(saved) - set(wanted))
        if unexpected:
            raise CheckpointError(
                f"checkpoint step {step} has {unexpected[0]} which the model does not "
                f"(different model or optimizer config); {fix}"
            )

    def _damaged(self, step: int, what: str, inference: bool) -> CheckpointError:
        """A checkpoint whose arrays restored but are wrong (a flipped bit, inf): what to use instead."""
        where = self.directory / str(step)
        older = [s for s in self.all_steps() if s < step]
        if not older:
            fix = "it has no earlier step; train again in a new out_dir"
        elif inference:
            fix = f"use an earlier step: --step {older[-1]}"
        else:
            fix = f"move {where} away to resume from step {older[-1]}"
        return CheckpointError(f"checkpoint step {step} ({where}) is damaged: {what}; {fix}")

    def _verify(self, step, restored: dict, saved: dict, checksums: dict, inference: bool):
        """Restored arrays against the checksums recorded at save (older checkpoints have none);
        for inference also finiteness, which covers those older checkpoints."""
        finite, sums = inspect(restored)
        for name, checksum in sums.items():  # a leaf restored in another dtype (cast) is not compared
            if name in checksums and saved[name][1] == restored[name].dtype and checksums[name] != checksum:
                what = f"{name} does not match the checksum recorded when it was saved"
                raise self._damaged(step, what, inference)
        bad = [k for k, ok in finite.items() if not ok]
        if inference and bad:
            raise self._damaged(step, f"{bad[0]} holds NaN or inf values", inference)

    def _restore_tree(self, step, abstract, prefix: str, extra: dict, partial: bool):
        impls = extra.get(_PRNG_IMPLS, {})
        named = state_tree.named_leaves(abstract)
        flat = {}
        for name, leaf in named:
            full = f"{prefix}/{name}" if prefix else name
            if state_tree.is_prng_key(leaf) and full not in impls:
                raise CheckpointError(
                    f"checkpoint step {step} stores {full} as raw data, not a typed "
                    "PRNG key; pass a uint32 key in the abstract state"
                )
            flat[full] = _abstract_leaf(leaf)
        saved = self.saved_shapes(step)
        if partial:
            saved = {k: v for k, v in saved.items() if k.startswith(prefix + "/")}
        wanted = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in flat.items()}
        # a full restore (resuming training) must match exactly; params for inference may be cast
        self._check_fits(step, saved, wanted, check_dtype=not partial)
        item = state_tree.nest(flat)
        restore_args = ocp.checkpoint_utils.construct_restore_args(item)
        args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=partial)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(state=args))["state"]
        except Exception as e:
            raise self._corrupt(step, e) from None
        restored_flat = dict(state_tree.named_leaves(restored))
        self._verify(step, restored_flat, saved, extra.get(_CHECKSUMS, {}), inference=partial)
        leaves = []
        for name, leaf in named:
            full = f"{prefix}/{name}" if prefix else name
            x = restored_flat[full]
            leaves.append(
                jax.random.wrap_key_data(x, impl=impls[full]) if state_tree.is_prng_key(leaf) else x
            )
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), leaves)

    def _raw_extra(self, step: int) -> dict:
        try:
            args = ocp.args.Composite(extra=ocp.args.JsonRestore())
            return dict(self._manager.restore(step, args=args)["extra"])
        except Exception as e:
            raise self._corrupt(step, e) from None

    def restore_extra(self, step: int | None = None) -> dict:
        """The JSON `extra` of `step` (default: the latest), with "step" and "val_loss" added by save."""
        extra = self._raw_extra(self._resolve_step(step))
        extra.pop(_PRNG_IMPLS, None)
        extra.pop(_CHECKSUMS, None)
        return extra

    def restore(self, step: int | None = None, *, abstract_state):
        """(state, extra) of `step` (default: the latest) laid out like `abstract_state`.

        `abstract_state` is the train state's pytree of jax.ShapeDtypeStruct (e.g. from jax.eval_shape)
        carrying the shardings to restore onto: any mesh and device count works, whatever the saving
        run used. Leaves without a sharding go to the first local device.
        """
        self.wait()
        step = self._resolve_step(step)
        extra = self._raw_extra(step)
        state = self._restore_tree(step, abstract_state, "", extra, partial=False)
        extra.pop(_PRNG_IMPLS, None)
        extra.pop(_CHECKSUMS, None)
        return state, extra

    def restore_params(self, step: int | None = None, *, abstract_params, path: str = "params"):
        """Only the `path` subtree of the saved state (no optimizer state is read): for inference.
        Checked against the saved checksums and for NaN / inf (one-line errors naming the step)."""
        self.wait()
        step = self._resolve_step(step)
        return self._restore_tree(step, abstract_params, path, self._raw_extra(step), partial=True)

    def abstract_params(self, step: int | None = None, path: str = "params", sharding=None):
        """ShapeDtypeStructs of the saved `path` subtree, placed on `sharding` (default: one local device;
        a tree of shardings like the subtree: each leaf on its own, orbax then reading on each device
        only its slices)."""
        step = self._resolve_step(step)
        sharding = sharding or _local_sharding()
        one = isinstance(sharding, jax.sharding.Sharding)
        placed = None if one else dict(state_tree.named_leaves(sharding))

        def of(name):
            if placed is None:
                return sharding
            if name not in placed:
                raise CheckpointError(f"checkpoint step {step} holds {path}/{name}, a leaf its model lacks")
            return placed[name]

        flat = {
            k[len(path) + 1 :]: jax.ShapeDtypeStruct(shape, dtype, sharding=of(k[len(path) + 1 :]))
            for k, (shape, dtype) in self.saved_shapes(step).items()
            if k.startswith(path + "/")
        }
        if not flat:
            tops = sorted({k.split("/")[0] for k in self.saved_shapes(step)})
            raise CheckpointError(
                f"checkpoint step {step} has no '{path}' subtree; its top-level entries "
                f"are {tops}; pass params_path=one of them"
            )
        return state_tree.nest(flat)


def _val_loss(metrics) -> float:
    return float(metrics.get("val_loss", math.inf))  # a step saved without an eval is never the best


def _good_step(metrics) -> float:
    return float(metrics.get("good_step", -1))


def load_for_inference(
    out_dir, step: int | None = None, *, params_path: str = "params", sharding=None, with_extra=False
):
    """Only the params of a run's checkpoint (default: the latest), on one local device (CPU is fine)
    or on `sharding` (one for every leaf, or a tree of them like the params);
    with `with_extra`, (params, extra): extra["step"] is the step loaded, extra["config"] / ["meta"]
    the run config and data meta it was trained with (flaxgpt.runs.run_dir.load_run uses them).

    The saved shardings are ignored, so a checkpoint trained on a GPU / TPU mesh loads on a CPU-only
    machine. Damaged arrays (checksum, NaN / inf) are a one-line CheckpointError naming an earlier step.
    """
    ckpt = Checkpointer(out_dir, read_only=True, async_save=False)
    try:
        step = ckpt._resolve_step(step)
        abstract = ckpt.abstract_params(step, params_path, sharding)
        params = ckpt.restore_params(step, abstract_params=abstract, path=params_path)
        return (params, ckpt.restore_extra(step)) if with_extra else params
    finally:
        ckpt.close()


__all__ = ["CheckpointError", "Checkpointer", "load_for_inference"]
