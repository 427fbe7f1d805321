"""GPT-2 weights from and to Hugging Face: an explicit key table, a shape check per tensor.

    config, params = load_pretrained("gpt2")            # hub or its cache (needs huggingface_hub)
    config, params = load_pretrained("path/to/dir")     # config.json + model.safetensors
    export_pretrained(config, params, "out/hf")         # then GPT2LMHeadModel.from_pretrained("out/hf")

    python -m flaxgpt.hf export --out_dir out/run --to out/hf     # a training run -> HF directory
    python -m flaxgpt.hf info gpt2                                 # the GPTConfig a checkpoint maps to

GPT-2 stores its Linear layers as Conv1D, whose weight is [in, out]: the same layout as
a flax Dense kernel, so blocks copy without transposes. Only an untied lm_head
(torch Linear, [out, in]) is transposed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from flaxgpt.gpt import GPTConfig, abstract_params, unstack_layers
from flaxgpt.layers import sinusoidal_positions

CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"

# flaxgpt activation <-> transformers ACT2FN name
ACT_TO_HF = {"gelu": "gelu_new", "gelu_exact": "gelu", "relu": "relu"}
HF_TO_ACT = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact", "relu": "relu"}

# GPTConfig fields a GPT-2 checkpoint fixes; the others (dropout, dtype, remat, ...) are free
ARCH_FIELDS = tuple(
    "vocab_size n_layer n_head n_embd pos_embedding activation tie_embeddings bias qkv_bias "
    "layer_norm_epsilon".split()
)

# HF name inside block i (after "h.{i}.") -> flaxgpt path inside h_{i}; Conv1D weight == Dense kernel
BLOCK_KEYS = {
    "ln_1.weight": ("ln_1", "scale"),
    "ln_1.bias": ("ln_1", "bias"),
    "attn.c_attn.weight": ("attn", "c_attn", "kernel"),  # [D, 3D], columns q | k | v, heads inside each
    "attn.c_attn.bias": ("attn", "c_attn", "bias"),
    "attn.c_proj.weight": ("attn", "c_proj", "kernel"),  # [D, D]
    "attn.c_proj.bias": ("attn", "c_proj", "bias"),
    "ln_2.weight": ("ln_2", "scale"),
    "ln_2.bias": ("ln_2", "bias"),
    "mlp.c_fc.weight": ("mlp", "c_fc", "kernel"),  # [D, 4D]
    "mlp.c_fc.bias": ("mlp", "c_fc", "bias"),
    "mlp.c_proj.weight": ("mlp", "c_proj", "kernel"),  # [4D, D]
    "mlp.c_proj.bias": ("mlp", "c_proj", "bias"),
}
TOP_KEYS = {
    "wte.weight": ("wte", "embedding"),  # [V, D]; flaxgpt may pad rows to padded_vocab_size
    "wpe.weight": ("wpe", "embedding"),  # [n_positions, D]; flaxgpt keeps the first block_size rows
    "ln_f.weight": ("ln_f", "scale"),
    "ln_f.bias": ("ln_f", "bias"),
}
# causal-mask buffers some GPT-2 files carry: not parameters
BUFFER_RE = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")


# ---------------------------------------------------------------- configs


def config_from_hf(hf: dict, **fields) -> GPTConfig:
    """A GPT-2 config.json (as a dict) -> GPTConfig; `fields` set the non-architecture fields."""
    if hf.get("model_type") != "gpt2":
        raise ValueError(f"not a GPT-2 config: model_type is {hf.get('model_type')!r}, expected 'gpt2'")
    act = hf.get("activation_function", "gelu_new")
    D = hf.get("n_embd", 768)
    unsupported = {
        "activation_function": act if act not in HF_TO_ACT else None,
        "n_inner": hf.get("n_inner") if hf.get("n_inner") not in (None, 4 * D) else None,
        "scale_attn_weights": False if hf.get("scale_attn_weights", True) is False else None,
        "scale_attn_by_inverse_layer_idx": True if hf.get("scale_attn_by_inverse_layer_idx") else None,
        "add_cross_attention": True if hf.get("add_cross_attention") else None,
    }
    for key, value in unsupported.items():
        if value is not None:
            raise ValueError(f"GPT-2 config with {key}={value!r} is not supported by flaxgpt's GPT")
    for key in fields:
        if key in ARCH_FIELDS:
            raise ValueError(f"{key} is fixed by the pretrained checkpoint and cannot be overridden")
    n_positions = hf.get("n_positions", 1024)
    block_size = fields.pop("block_size", None) or n_positions
    if block_size > n_positions:
        raise ValueError(f"block_size {block_size} is longer than the checkpoint's n_positions {n_positions}")
    # dropout 0 unless asked: inference is the common use; fine-tuning passes its own
    fields = {"embd_dropout": 0.0, "attn_dropout": 0.0, "resid_dropout": 0.0, **fields}
    return GPTConfig(
        vocab_size=hf.get("vocab_size", 50257),
        block_size=block_size,
        n_layer=hf.get("n_layer", 12),
        n_head=hf.get("n_head", 12),
        n_embd=D,
        activation=HF_TO_ACT[act],
        tie_embeddings=hf.get("tie_word_embeddings", True),
        layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        **fields,
    )


def config_to_hf(config: GPTConfig) -> dict:
    """GPTConfig -> GPT-2 config.json. Everything a GPTConfig describes maps (see export_pretrained)."""
    eos = 50256 if config.vocab_size > 50256 else None  # GPT-2's <|endoftext|>, only with its tokenizer
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "activation_function": ACT_TO_HF[config.activation],
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "tie_word_embeddings": config.tie_embeddings,
        "embd_pdrop": config.embd_dropout,
        "attn_pdrop": config.attn_dropout,
        "resid_pdrop": config.resid_dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "dtype": "float32",
    }


# ---------------------------------------------------------------- finding the files


def resolve(name_or_path: str, cache_dir: str | None = None) -> str:
    """A local directory as is, else a hub repo id (gpt2, gpt2-xl, ...) fetched or found in the HF cache."""
    path = os.path.expanduser(str(name_or_path))
    if os.path.isdir(path):
        return path
    if path.startswith((".", "/", "~")) or os.path.exists(path):
        raise FileNotFoundError(
            f"{name_or_path!r} is not a directory; pass a directory holding "
            f"{CONFIG_FILE} and {WEIGHTS_FILE}, or a hub name such as gpt2"
        )
    try:
        import huggingface_hub
        from huggingface_hub import constants
    except ImportError as e:
        raise ImportError(
            f"loading {name_or_path!r} from the hub needs huggingface_hub: "
            "pip install 'flaxgpt[hf]', or pass a local directory"
        ) from e
    env = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    offline = bool(constants.HF_HUB_OFFLINE) or env
    # the hub redirects gpt2 -> openai-community/gpt2; a cache may hold either name
    repos = [path] + ([f"openai-community/{path}"] if path in GPTConfig.PRESETS else [])
    for repo in repos:
        filename = CONFIG_FILE
        try:
            cfg = huggingface_hub.hf_hub_download(
                repo, filename, cache_dir=cache_dir, local_files_only=offline
            )
            filename = WEIGHTS_FILE
            huggingface_hub.hf_hub_download(repo, filename, cache_dir=cache_dir, local_files_only=offline)
            return os.path.dirname(cfg)
        except Exception as e:  # matched by name: the classes moved between huggingface_hub versions
            kind = type(e).__name__
            if kind in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
                raise FileNotFoundError(f"hub repo {repo!r} has no {filename}") from e
            if kind in ("RepositoryNotFoundError", "GatedRepoError") and repo == repos[-1]:
                raise FileNotFoundError(
                    f"no public hub repo {repo!r} and no local directory of that name; "
                    "GPT-2 sizes: " + ", ".join(GPTConfig.PRESETS)
                ) from e
            last = e  # not cached / offline / no network: the message below
    why = "HF_HUB_OFFLINE is set" if offline else f"the hub could not be reached ({type(last).__name__})"
    raise ConnectionError(  # an OSError: callers catching file errors catch this too
        f"{name_or_path!r} is not a local directory nor in the Hugging Face cache, and {why}: "
        "downloading it needs the network, or pass a local directory with "
        f"{CONFIG_FILE} and {WEIGHTS_FILE}"
    )


@contextlib.contextmanager
def _open_tensors(directory: str):
    """{name without 'transformer.': (open safetensors file, name in file)} for one or sharded files."""
    from safetensors import safe_open

    single, index = os.path.join(directory, WEIGHTS_FILE), os.path.join(directory, INDEX_FILE)
    if os.path.exists(single):
        files = [single]
    elif os.path.exists(index):
        with open(index) as fh:
            files = sorted({os.path.join(directory, f) for f in json.load(fh)["weight_map"].values()})
    else:
        found = ", ".join(sorted(os.listdir(directory))) or "nothing"
        raise FileNotFoundError(
            f"no {WEIGHTS_FILE} in {directory} (found: {found}); flaxgpt reads "
            "safetensors only: re-save with save_pretrained(safe_serialization=True)"
        )
    with contextlib.ExitStack() as stack:
        table = {}
        for file in files:
            handle = stack.enter_context(safe_open(file, framework="np"))
            if any(handle.get_slice(k).get_dtype() == "BF16" for k in handle.keys()):
                handle = stack.enter_context(safe_open(file, framework="flax"))  # numpy has no bfloat16
            for key in handle.keys():
                table[key.removeprefix("transformer.")] = (handle, key)
        yield table


# ---------------------------------------------------------------- import


def _read(table, name: str, shape: tuple, dtype) -> np.ndarray:
    """One tensor as an aligned host array, shape-checked: host memory stays ~ model + one tensor."""
    handle, key = table[name]
    found = tuple(handle.get_slice(key).get_shape())
    if found != tuple(shape):
        raise ValueError(f"tensor {key} has shape {found}, expected {tuple(shape)} from the config")
    return _aligned_copy(np.asarray(handle.get_tensor(key)), dtype)


def _aligned_copy(x: np.ndarray, dtype, shape=None) -> np.ndarray:
    """x cast into a 64-byte-aligned buffer (of `shape`, zero-padded at the end of each axis)."""
    out = _aligned_empty(shape or x.shape, dtype)
    if out.shape != x.shape:
        out[...] = 0
    out[tuple(slice(0, n) for n in x.shape)] = x
    return out


def _aligned_empty(shape: tuple, dtype) -> np.ndarray:
    """np.empty on a 64-byte boundary, which lets device_put on CPU adopt the buffer without a copy."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _set(tree: dict, path: tuple, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def load_pretrained(
    name_or_path: str,
    *,
    scan_layers: bool = False,
    pad_vocab_multiple: int = 1,
    param_dtype: str = "float32",
    cache_dir: str | None = None,
    **overrides,
):
    """GPT-2 weights -> (GPTConfig, params) for `GPT(config).apply({"params": params}, tokens)`.

    `name_or_path`: a directory with config.json + model.safetensors, or a hub name
    (gpt2, gpt2-medium, gpt2-large, gpt2-xl) found in the HF cache or downloaded.
    `overrides`: GPTConfig fields that do not change the architecture (dtype, dropout,
    block_size <= n_positions, attention_impl, remat).
    """
    directory = resolve(name_or_path, cache_dir)
    cfg_file = os.path.join(directory, CONFIG_FILE)
    if not os.path.exists(cfg_file):
        raise FileNotFoundError(
            f"no {CONFIG_FILE} in {directory}; a GPT-2 directory holds {CONFIG_FILE} and {WEIGHTS_FILE}"
        )
    with open(cfg_file) as fh:
        hf = json.load(fh)
    config = config_from_hf(
        hf,
        scan_layers=scan_layers,
        pad_vocab_multiple=pad_vocab_multiple,
        param_dtype=param_dtype,
        **overrides,
    )
    n_positions = hf.get("n_positions", 1024)
    flat = dataclasses.replace(config, scan_layers=False, pad_vocab_multiple=1, block_size=n_positions)
    shapes = nn.unbox(abstract_params(flat))  # the HF shapes: unpadded vocab, all n_positions rows
    dtype = jnp.dtype(param_dtype)
    L = config.n_layer

    with _open_tensors(directory) as table:
        expected = set(TOP_KEYS) | {f"h.{i}.{k}" for i in range(L) for k in BLOCK_KEYS}
        if not config.tie_embeddings:
            expected.add("lm_head.weight")
        missing = sorted(expected - set(table))
        extra = set(table) - expected - {"lm_head.weight"}  # a tied file may still carry lm_head
        unexpected = sorted(k for k in extra if not BUFFER_RE.match(k))
        if missing or unexpected:
            raise ValueError(
                f"{directory} is not a GPT-2 checkpoint for its config: missing {missing[:5]} "
                f"unexpected {unexpected[:5]}"
            )
        params: dict = {}
        # host numpy work in 64-byte-aligned buffers, then one device_put per leaf, which on CPU
        # adopts such a buffer without a copy: no per-shape compiles, host memory ~ model size
        for name, path in TOP_KEYS.items():
            _set(params, path, _read(table, name, _get(shapes, path).shape, dtype))
        params["wpe"]["embedding"] = params["wpe"]["embedding"][: config.block_size]
        D, PV = config.n_embd, config.padded_vocab_size
        # padded rows are never seen (logits are sliced); zeros keep them inert
        params["wte"]["embedding"] = _aligned_copy(params["wte"]["embedding"], dtype, (PV, D))
        if not config.tie_embeddings:  # a tied file's lm_head is ignored, as transformers does
            w_VD = _read(table, "lm_head.weight", (config.vocab_size, D), dtype)  # torch Linear: [out, in]
            params["lm_head"] = {"kernel": _aligned_copy(w_VD.T, dtype, (D, PV))}
        params = jax.tree_util.tree_map(jax.device_put, params)
        for key, path in BLOCK_KEYS.items():
            shape = _get(shapes["h_0"], path).shape
            if scan_layers:  # one [L, ...] host buffer per leaf kind, filled layer by layer
                stacked = _aligned_empty((L, *shape), dtype)
                for i in range(L):
                    stacked[i] = _read(table, f"h.{i}.{key}", shape, dtype)
                _set(params, ("h", "block") + path, jax.device_put(stacked))
                del stacked
            else:
                for i in range(L):
                    x = _read(table, f"h.{i}.{key}", shape, dtype)
                    _set(params, (f"h_{i}",) + path, jax.device_put(x))
    return config, params


def load_for_run(init_from: str, model_cfg):
    """train.py's init_from=<gpt2 name | directory>: the checkpoint fixes the architecture, the run's
    `model` section (configs/default.py) the rest: dropout, dtypes, layout, block_size <= n_positions."""
    m = model_cfg
    return load_pretrained(
        init_from,
        scan_layers=m.scan_layers,
        pad_vocab_multiple=m.pad_vocab_multiple,
        param_dtype=m.param_dtype,
        dtype=m.dtype,
        embd_dropout=m.dropout,
        attn_dropout=m.dropout,
        resid_dropout=m.dropout,
        attention_impl=m.attention_impl,
        remat=m.remat,
        block_size=m.block_size,
    )


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


# ---------------------------------------------------------------- export


def _as_config(config) -> GPTConfig:
    """A GPTConfig, or a run's model dict (GPTConfig fields + "kind", maybe one "dropout")."""
    if isinstance(config, GPTConfig):
        return config
    d = dict(config)
    kind = d.pop("kind", "gpt")
    if kind != "gpt":
        raise ValueError(f"only GPT models export to GPT-2; this checkpoint is kind={kind!r}")
    if "dropout" in d:  # the run config's single dropout knob
        p = d.pop("dropout")
        d.update(embd_dropout=p, attn_dropout=p, resid_dropout=p)
    return GPTConfig.from_dict(d)


def export_state(config, params) -> tuple[dict, dict]:
    """(config.json dict, {HF name: float32 numpy array}) for a flaxgpt GPT.

    Every GPTConfig maps onto GPT-2: no bias -> zero biases, sinusoidal positions -> a
    wpe table holding the same encoding, activations -> their ACT2FN names, an untied
    head -> tie_word_embeddings=False.
    """
    config = _as_config(config)
    params = nn.unbox(params)
    if config.scan_layers:
        params = unstack_layers(params, config.n_layer)
    V, PV, D = config.vocab_size, config.padded_vocab_size, config.n_embd
    # with every bias present: a bias-free model exports zeros in their place
    flat = dataclasses.replace(config, scan_layers=False, pad_vocab_multiple=1, bias=True, qkv_bias=True)
    block_shapes = nn.unbox(abstract_params(flat))["h_0"]

    def get(path, shape):
        """params[path] as float32 numpy, shape-checked; an absent bias the config omits is zero."""
        try:
            x = _get(params, path)
        except KeyError:
            omitted = not config.bias or (path[-2] == "c_attn" and not config.qkv_bias)
            if path[-1] == "bias" and omitted:
                return np.zeros(shape, np.float32)
            raise ValueError(f"params have no {'/'.join(path)}; do they belong to this config?") from None
        x = np.asarray(jax.device_get(x), dtype=np.float32)
        if x.shape != tuple(shape):
            raise ValueError(
                f"param {'/'.join(path)} has shape {x.shape}, expected {tuple(shape)} from the config"
            )
        return x

    tensors = {"transformer.wte.weight": get(("wte", "embedding"), (PV, D))[:V]}  # strip vocab padding
    if config.pos_embedding == "learned":
        tensors["transformer.wpe.weight"] = get(("wpe", "embedding"), (config.block_size, D))
    else:
        pos = sinusoidal_positions(jnp.arange(config.block_size), D)
        tensors["transformer.wpe.weight"] = np.asarray(pos, np.float32)
    tensors["transformer.ln_f.weight"] = get(("ln_f", "scale"), (D,))
    tensors["transformer.ln_f.bias"] = get(("ln_f", "bias"), (D,))
    if not config.tie_embeddings:  # torch Linear is [out, in]
        tensors["lm_head.weight"] = np.ascontiguousarray(get(("lm_head", "kernel"), (D, PV))[:, :V].T)
    for i in range(config.n_layer):
        for key, path in BLOCK_KEYS.items():
            tensors[f"transformer.h.{i}.{key}"] = get((f"h_{i}",) + path, _get(block_shapes, path).shape)
    return config_to_hf(config), tensors


def export_pretrained(config, params, out_dir: str) -> str:
    """Write out_dir/config.json + model.safetensors for transformers.GPT2LMHeadModel.from_pretrained."""
    from safetensors.numpy import save_file

    hf, tensors = export_state(config, params)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as fh:
        json.dump(hf, fh, indent=2)
    return out_dir


# ---------------------------------------------------------------- CLI


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flaxgpt.hf", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="write a training run as a Hugging Face GPT-2 directory")
    ex.add_argument("--out_dir", required=True, help="flaxgpt training run directory")
    ex.add_argument("--to", required=True, help="directory to write config.json + model.safetensors into")
    ex.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    info = sub.add_parser("info", help="print the GPTConfig a GPT-2 name or directory maps to")
    info.add_argument("name_or_path")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "export":
            from flaxgpt.checkpoint import load_for_inference

            model_config, params, _ = load_for_inference(args.out_dir, step=args.step)
            export_pretrained(model_config, params, args.to)
            print(
                f"wrote {os.path.join(args.to, WEIGHTS_FILE)} and {CONFIG_FILE}; load it with "
                f"transformers.GPT2LMHeadModel.from_pretrained({args.to!r})"
            )
        else:
            directory = resolve(args.name_or_path)
            with open(os.path.join(directory, CONFIG_FILE)) as fh:
                print(json.dumps(config_from_hf(json.load(fh)).to_dict(), indent=2))
    except (ValueError, OSError, ImportError) as e:  # CheckpointError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
