"""Checkpoints: an orbax CheckpointManager in out_dir/checkpoints, restorable onto any mesh.

    ckpt = Checkpointer(out_dir, keep=3, keep_best=True)          # async saves
    ckpt.save(step, state, extra={"data_step": step, "config": cfg_dict}, val_loss=vl)
    state, extra = ckpt.restore(abstract_state=abstract)          # latest step, onto abstract's shardings
    params = ckpt.restore_params(abstract_params=abstract["params"])
    ckpt.wait(); ckpt.close()                                     # before the process exits
    model_cfg, params, meta = load_for_inference(out_dir)         # params on one local device, e.g. a CPU

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

import json
import logging
import math
import signal
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as ocp_managers

log = logging.getLogger(__name__)


class _QuietMissingMetrics(logging.Filter):
    """orbax warns on each save without metrics when tracking the best; steps without an eval are normal."""

    def filter(self, record):
        return "did not provide metrics" not in record.getMessage()


logging.getLogger("absl").addFilter(_QuietMissingMetrics())

_PRNG_IMPLS = "_prng_impls"  # reserved key in extra: path -> PRNG impl name of each typed key


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, found or restored; the message is one line."""


# ----------------------------------------------------------------------------- pytree <-> nested dict


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _is_prng_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _named_leaves(tree) -> list[tuple[str, object]]:
    """[("params/h_0/attn/c_attn/kernel", leaf), ...] in tree order."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = [("/".join(_key_name(k) for k in path), leaf) for path, leaf in leaves]
    names = [n for n, _ in out]
    if "" in names or len(set(names)) != len(names):
        raise CheckpointError("the state must be a dict-like pytree whose leaves have distinct key paths")
    return out


def _nest(flat: dict[str, object]) -> dict:
    nested: dict = {}
    for name, leaf in flat.items():
        node = nested
        *parents, last = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return nested


def _flatten_metadata(tree, prefix="") -> dict[str, object]:
    """Nested dict of orbax ArrayMetadata -> {"a/b/c": metadata}."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        out.update(_flatten_metadata(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def _local_sharding():
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _abstract_leaf(x):
    """A ShapeDtypeStruct to restore into; typed PRNG keys become their uint32 key_data."""
    sharding = getattr(x, "sharding", None) or _local_sharding()
    if _is_prng_key(x):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        # a NamedSharding spec covers the leading (key) dims; the trailing key_data dim is replicated
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


@jax.jit
def _all_finite_leaves(leaves):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def all_finite(tree) -> bool:
    """True when every float leaf of `tree` is finite (no NaN / inf); one jitted reduction."""
    leaves = [
        x
        for x in jax.tree_util.tree_leaves(tree)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return not leaves or bool(_all_finite_leaves(leaves))


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


# ----------------------------------------------------------------------------- the checkpointer


class Checkpointer:
    """Saves and restores (state, extra) under out_dir/checkpoints; keeps the latest `keep` + the best.

    Retention: orbax keeps a step if LatestN(keep) or BestN(n=1 by val_loss) wants it; steps saved
    without a val_loss only live while they are among the latest `keep`. So there are at most keep + 1
    checkpoints, and the best one survives later, worse evals and restarts (val_loss is stored per step).
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
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp_managers.AnyPreservationPolicy(policies),
            best_fn=_val_loss if keep_best else None,  # makes orbax write the per-step metrics file
            best_mode="min",
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only,  # unfinished saves of a killed run
            read_only=read_only,
            create=not read_only,
        )
        handlers = {"state": ocp.PyTreeCheckpointHandler(), "extra": ocp.JsonCheckpointHandler()}
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
        """The step with the lowest val_loss (the latest step when none has one)."""
        return self._manager.best_step()

    # -- saving

    def save(
        self, step: int, state, *, extra: dict, val_loss: float | None = None, force: bool = False
    ) -> bool:
        """Starts an async save of `state` + JSON `extra` at `step`; False if the step was not saved.

        Never overwrites: a step that already exists (or is older than the latest) is skipped.
        Refuses non-finite floats, so NaN weights never replace a good checkpoint.
        """
        step = int(step)
        latest = self.latest_step()
        if latest is not None and step <= latest:
            log.info("checkpoint: step %d not saved, the directory already holds step %d", step, latest)
            return False
        if not all_finite(state):
            raise CheckpointError(
                f"refusing to save step {step}: the state has NaN or inf values; "
                f"the last good checkpoint is step {latest}"
            )
        flat, impls = {}, {}
        for name, leaf in _named_leaves(state):
            if _is_prng_key(leaf):
                impls[name] = str(jax.random.key_impl(leaf))
                leaf = jax.random.key_data(leaf)
            flat[name] = leaf
        extra = {**extra, "step": step, "val_loss": val_loss, _PRNG_IMPLS: impls}
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint extra must be JSON: {_one_line(e)}") from None
        metrics = None
        if val_loss is not None and math.isfinite(val_loss):
            metrics = {"val_loss": float(val_loss)}
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(_nest(flat)), extra=ocp.args.JsonSave(extra))
        try:
            return self._manager.save(step, args=args, metrics=metrics, force=force)
        except OSError as e:
            raise CheckpointError(f"saving step {step} to {self.directory} failed: {_one_line(e)}") from None

    def wait(self):
        """Blocks until the async save in flight (if any) is on disk."""
        try:
            self._manager.wait_until_finished()
        except OSError as e:
            raise CheckpointError(f"saving to {self.directory} failed: {_one_line(e)}") from None

    def close(self):
        self.wait()
        # orbax's close() does not wait for its start-up cleanup of unfinished saves; a process
        # that exits right after (a one-line error) would otherwise print its thread's traceback
        getattr(self._manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()
        self._manager.close()

    # -- restoring

    def _resolve_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(
                f"{self.out_dir} has no checkpoint (init_from=resume needs one); "
                "use init_from=scratch or point out_dir at a run with checkpoints"
            )
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(f"{self.out_dir} has no checkpoint for step {step}; it has steps {steps}")
        return step

    def _corrupt(self, step: int, e: BaseException) -> CheckpointError:
        """Damaged files (or another reason orbax cannot read a step): name it and the step before it."""
        where = self.directory / str(step)
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
            return {k: (tuple(m.shape), np.dtype(m.dtype)) for k, m in _flatten_metadata(tree).items()}
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

    def _restore_tree(self, step, abstract, prefix: str, impls: dict, partial: bool):
        named = _named_leaves(abstract)
        flat = {}
        for name, leaf in named:
            full = f"{prefix}/{name}" if prefix else name
            if _is_prng_key(leaf) and full not in impls:
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
        item = _nest(flat)
        restore_args = ocp.checkpoint_utils.construct_restore_args(item)
        args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=partial)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(state=args))["state"]
        except Exception as e:
            raise self._corrupt(step, e) from None
        restored_flat = dict(_named_leaves(restored))
        leaves = []
        for name, leaf in named:
            full = f"{prefix}/{name}" if prefix else name
            x = restored_flat[full]
            leaves.append(jax.random.wrap_key_data(x, impl=impls[full]) if _is_prng_key(leaf) else x)
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
        impls = extra.pop(_PRNG_IMPLS, {})
        state = self._restore_tree(step, abstract_state, "", impls, partial=False)
        return state, extra

    def restore_params(self, step: int | None = None, *, abstract_params, path: str = "params"):
        """Only the `path` subtree of the saved state (no optimizer state is read): for inference."""
        self.wait()
        step = self._resolve_step(step)
        impls = self._raw_extra(step).get(_PRNG_IMPLS, {})
        return self._restore_tree(step, abstract_params, path, impls, partial=True)

    def abstract_params(self, step: int | None = None, path: str = "params", sharding=None):
        """ShapeDtypeStructs of the saved `path` subtree, placed on `sharding` (default: one local device)."""
        step = self._resolve_step(step)
        sharding = sharding or _local_sharding()
        flat = {
            k[len(path) + 1 :]: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
            for k, (shape, dtype) in self.saved_shapes(step).items()
            if k.startswith(path + "/")
        }
        if not flat:
            tops = sorted({k.split("/")[0] for k in self.saved_shapes(step)})
            raise CheckpointError(
                f"checkpoint step {step} has no '{path}' subtree; its top-level entries "
                f"are {tops}; pass params_path=one of them"
            )
        return _nest(flat)


def _val_loss(metrics) -> float:
    return float(metrics["val_loss"])


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; {what}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read ({_one_line(e)}); {what}") from None


def load_for_inference(out_dir, step: int | None = None, *, params_path: str = "params", sharding=None):
    """(model_config_dict, params, meta) of a training run, params on one local device (CPU is fine).

    Reads out_dir/config.json (its "model" entry, with "kind": "gpt" or "seq2seq"), out_dir/meta.json
    (tokenizer meta; None when the run has none) and only the params of the checkpoint. The saved
    shardings are ignored, so a checkpoint trained on a GPU / TPU mesh loads on a CPU-only machine.
    """
    out_dir = Path(out_dir)
    config = _read_json(out_dir / "config.json", "point out_dir at a flaxgpt training run")
    if "model" not in config:
        raise CheckpointError(f"{out_dir / 'config.json'} has no 'model' entry; is it a flaxgpt run config?")
    meta_path = out_dir / "meta.json"
    meta = _read_json(meta_path, "") if meta_path.exists() else None
    ckpt = Checkpointer(out_dir, read_only=True, async_save=False)
    try:
        abstract = ckpt.abstract_params(step, params_path, sharding)
        params = ckpt.restore_params(step, abstract_params=abstract, path=params_path)
    finally:
        ckpt.close()
    return config["model"], params, meta


def resume_step(ckpt: Checkpointer, init_from: str = "auto") -> int | None:
    """The step to restore for `init_from`; None means start fresh (from scratch or pretrained weights).

    auto (the default): the latest checkpoint if out_dir has one, else None.
    resume: the latest checkpoint; an error when there is none.
    scratch: an error when out_dir already has checkpoints, so a new run never deletes or overwrites them.
    a pretrained name or path: the latest checkpoint if it was saved by a run with the same init_from
    (a preempted fine-tune continues), else as scratch.
    """
    latest = ckpt.latest_step()
    if init_from == "auto":
        return latest
    if init_from != "scratch" and latest is not None:
        saved = ckpt.restore_extra(latest).get("config") or {}
        if saved.get("init_from") == init_from:
            return latest
    if init_from == "resume":
        if latest is None:
            raise CheckpointError(
                f"init_from=resume but {ckpt.out_dir} has no checkpoint; "
                "use init_from=scratch or point out_dir at a run with checkpoints"
            )
        return latest
    if latest is not None:
        raise CheckpointError(
            f"init_from={init_from} but {ckpt.out_dir} already has checkpoints up to step "
            f"{latest}; use init_from=resume or a new out_dir"
        )
    return None


class StopSignal:
    """Remembers a SIGTERM (what TPU VMs and schedulers send before preempting) instead of dying.

    The loop checks `stop.requested(step)` after each step: finish the step, save, exit 0. With several
    processes they all agree (one small host all-gather every `every` steps), so all save the same step.
    """

    def __init__(self, signals=(signal.SIGTERM,), every: int = 1):
        self.received: str | None = None
        self.every = max(1, every)
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # Python only allows it there
            self._previous = {s: signal.signal(s, self._handler) for s in signals}

    def _handler(self, signum, frame):
        self.received = signal.Signals(signum).name

    def requested(self, step: int) -> bool:
        if jax.process_count() == 1:
            return self.received is not None
        if step % self.every:
            return False
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.received is not None))
        return bool(np.any(flags))

    def close(self):
        """Puts the previous handlers back."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


__all__ = ["CheckpointError", "Checkpointer", "StopSignal", "all_finite", "load_for_inference", "resume_step"]
