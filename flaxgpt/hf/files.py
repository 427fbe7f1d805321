"""The files of a Hugging Face model: where they are, reading them one tensor at a time, writing them.

    directory = resolve("gpt2")                  # or resolve("path/to/dir"): a hub name or a directory
    with open_tensors(directory) as table:       # {"h.0.attn.c_attn.weight": (handle, key in file), ...}
        w = read(table, "ln_f.weight", (768,), np.float32)   # shape-checked, 64-byte aligned
    write_safetensors(tensors, out_dir, max_shard_bytes=2**30)   # sharded + index when it is big

One model.safetensors or a sharded set with model.safetensors.index.json (every shard it names must
be there); names lose "transformer." (GPT-2's prefix). Reading keeps host memory near the model's
size: each tensor is cast into a 64-byte-aligned buffer, which `jax.device_put` on CPU adopts without
a copy. flaxgpt.hf.gpt2 (GPT-2) and flaxgpt.hf.llama (Llama, Mistral, Qwen2) map the tensors onto params.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import urllib.parse

import numpy as np

CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"
GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # hub names under openai-community/
OPTIONAL_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
MISSING_ENTRY = ("EntryNotFoundError", "RemoteEntryNotFoundError")  # huggingface_hub's, by name


def resolve(name_or_path: str, cache_dir: str | None = None) -> str:
    """A local directory as is, else a hub repo id (gpt2, HuggingFaceTB/SmolLM2-135M, ...) fetched or
    found in the HF cache: config.json, the safetensors (one file, or the index and its shards) and,
    when the repo has them, its tokenizer files."""
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
            "pip install -e '.[hf]', or pass a local directory"
        ) from e
    env = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    offline = bool(constants.HF_HUB_OFFLINE) or env
    unreachable = not offline and not hub_reachable(constants.ENDPOINT)
    offline = offline or unreachable  # then only the cache: huggingface_hub would retry for ~25 s
    # the hub redirects gpt2 -> openai-community/gpt2; a cache may hold either name
    repos = [path] + ([f"openai-community/{path}"] if path in GPT2_NAMES else [])
    for repo in repos:
        filename = CONFIG_FILE
        try:
            cfg = huggingface_hub.hf_hub_download(
                repo, filename, cache_dir=cache_dir, local_files_only=offline
            )
            filename = WEIGHTS_FILE
            kw = dict(cache_dir=cache_dir, local_files_only=offline)
            _hub_weights(huggingface_hub.hf_hub_download, repo, **kw)
            for optional in OPTIONAL_FILES:  # a Llama-family model's tokenizer
                with contextlib.suppress(Exception):
                    huggingface_hub.hf_hub_download(repo, optional, **kw)
            return os.path.dirname(cfg)
        except Exception as e:  # matched by name: the classes moved between huggingface_hub versions
            kind = type(e).__name__
            if isinstance(e, MissingWeightsError):
                raise
            if kind in MISSING_ENTRY:
                raise FileNotFoundError(f"hub repo {repo!r} has no {filename}") from e
            if kind in ("RepositoryNotFoundError", "GatedRepoError") and repo == repos[-1]:
                raise FileNotFoundError(
                    f"no public hub repo {repo!r} and no local directory of that name; "
                    + (near_name(path) or "GPT-2 sizes: " + ", ".join(GPT2_NAMES))
                ) from e
            last = e  # not cached / offline / no network: the message below
    if unreachable:
        why = f"{constants.ENDPOINT} cannot be reached (offline?)"
    elif offline:
        why = "HF_HUB_OFFLINE is set"
    else:
        why = f"the hub could not be reached ({type(last).__name__})"
    near = near_name(path)  # a typo: the name it means, before the network advice
    cache = cache_dir or constants.HF_HUB_CACHE  # where a copy made elsewhere must go ($HF_HUB_CACHE)
    raise ConnectionError(  # an OSError: callers catching file errors catch this too
        f"{name_or_path!r} is not a local directory nor in the Hugging Face cache {cache}, and {why}: "
        + (f"{near} Else: " if near else "")
        + f"downloading it needs the network (once, into that cache: hf download {repos[-1]} "
        "--include '*.json' --include '*.safetensors'), or pass a "
        f"local directory with {CONFIG_FILE} and {WEIGHTS_FILE} (docs/pretrained.md, 'Offline')"
    )


def near_name(name: str, known=()) -> str | None:
    """'did you mean gpt2-medium?' when `name` is a near miss of a GPT-2 size, a preset or one of
    `known` (the loader passes the family table's hf.families.PUBLISHED: this module is below
    hf.families in the import order), else None."""
    from flaxgpt import errors
    from flaxgpt.models.gpt_config import GPTConfig

    known = [*GPT2_NAMES, *known, *GPTConfig.PRESETS]
    if name in known:
        return None
    if name.lower() in ("gpt2-small", "gpt2-124m", "gpt-2"):  # what people call the 124M model
        return errors.suggest("gpt2")
    # 0.8, stricter than a choice's 0.6: any path or hub id reaches here, and most are no typo
    return errors.did_you_mean(name, known, cutoff=0.8) or None


def hub_reachable(endpoint: str, timeout: float = 3.0) -> bool:
    """A TCP connection to the hub's host opens within `timeout` (always True behind a proxy, which
    huggingface_hub then uses)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urllib.parse.urlparse(endpoint)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:  # no DNS, no route, refused, timed out
        return False


class MissingWeightsError(FileNotFoundError):
    """A hub repo with neither model.safetensors nor the index of its shards."""


def _hub_weights(download, repo: str, **kw) -> None:
    """model.safetensors, else the index and every shard it names, into the HF cache."""
    try:
        download(repo, WEIGHTS_FILE, **kw)
        return
    except Exception as e:
        if type(e).__name__ not in MISSING_ENTRY:
            raise
    try:
        with open(download(repo, INDEX_FILE, **kw)) as fh:
            shards = sorted(set(json.load(fh)["weight_map"].values()))
    except Exception as e:
        if type(e).__name__ not in MISSING_ENTRY + ("FileNotFoundError",):
            raise
        raise MissingWeightsError(f"hub repo {repo!r} has no {WEIGHTS_FILE} nor {INDEX_FILE}") from e
    for shard in shards:
        download(repo, shard, **kw)


def read_json(path: str, what: str = "a JSON object") -> dict:
    """A checkpoint's JSON file (config.json, the index, adapter_config.json) as a dict; a file that
    is not JSON or not an object is a one-line ValueError naming it (an interrupted copy, a hand edit)."""
    try:
        with open(path) as fh:
            out = json.load(fh)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); copy or download it again") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path} holds a JSON {type(out).__name__}, not {what}")
    return out


def require_ints(model_type: str, hf: dict, keys, optional=()) -> None:
    """config.json's sizes are integers: `keys` must be, `optional` ones when present and not null."""
    for key in (*keys, *(k for k in optional if hf.get(k) is not None)):
        value = hf.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"{model_type} config.json has {key}={value!r}; it must be an integer (fix the file)"
            )


# config.json values of any family that must be numbers when present (not null): read unchecked, a
# string here failed deep inside (a comparison in GPTConfig, RMSNorm's jitted epsilon) as a traceback
INT_FIELDS = (
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "intermediate_size",
    "n_inner",
)
FLOAT_FIELDS = (
    "rms_norm_eps",
    "layer_norm_epsilon",
    "rope_theta",
    "rope_local_base_freq",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "router_aux_loss_coef",
)


def require_numbers(model_type: str, hf: dict) -> None:
    """INT_FIELDS integers and FLOAT_FIELDS numbers wherever config.json sets them (a one-line error)."""
    require_ints(model_type, hf, (), optional=INT_FIELDS)
    for key in FLOAT_FIELDS:
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(
                f"{model_type} config.json has {key}={value!r}; it must be a number (fix the file)"
            )


def safetensors_error(file: str, e: Exception) -> ValueError:
    """A safetensors file its reader refuses (truncated by an interrupted download or copy) as one line."""
    return ValueError(f"{file} is not a readable safetensors file ({e}); copy or download it again")


def shard_files(directory: str) -> list[str]:
    """The safetensors files of a directory: model.safetensors, or every shard its index names."""
    single, index = os.path.join(directory, WEIGHTS_FILE), os.path.join(directory, INDEX_FILE)
    if os.path.exists(single):
        return [single]
    if not os.path.exists(index):
        found = ", ".join(sorted(os.listdir(directory))) or "nothing"
        raise FileNotFoundError(
            f"no {WEIGHTS_FILE} in {directory} (found: {found}); flaxgpt reads safetensors only "
            f"(one file, or {INDEX_FILE} and its shards): save_pretrained(safe_serialization=True)"
        )
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no 'weight_map' object (tensor name -> shard file); fix the file")
    names = sorted(set(weight_map.values()))
    missing = [n for n in names if not os.path.exists(os.path.join(directory, n))]
    if missing:
        raise FileNotFoundError(
            f"{INDEX_FILE} in {directory} names {len(names)} shard files but {len(missing)} are missing: "
            + ", ".join(missing)
        )
    return [os.path.join(directory, n) for n in names]


@contextlib.contextmanager
def open_tensors(directory: str):
    """{name without 'transformer.': (open safetensors file, name in the file)} over every shard."""
    from safetensors import SafetensorError, safe_open

    with contextlib.ExitStack() as stack:
        table = {}
        for file in shard_files(directory):
            try:
                handle = stack.enter_context(safe_open(file, framework="np"))
            except SafetensorError as e:
                raise safetensors_error(file, e) from None
            if any(handle.get_slice(k).get_dtype() == "BF16" for k in handle.keys()):
                handle = stack.enter_context(safe_open(file, framework="flax"))  # numpy has no bfloat16
            for key in handle.keys():
                table[key.removeprefix("transformer.")] = (handle, key)
        yield table


def read(table, name: str, shape: tuple, dtype) -> np.ndarray:
    """One tensor as an aligned host array of `dtype`, shape-checked: the error names both shapes."""
    handle, key = table[name]
    found = tuple(handle.get_slice(key).get_shape())
    if found != tuple(shape):
        raise ValueError(f"tensor {key} has shape {found}, expected {tuple(shape)} from the config")
    return aligned_copy(np.asarray(handle.get_tensor(key)), dtype)


def aligned_copy(x: np.ndarray, dtype, shape=None) -> np.ndarray:
    """x cast into a 64-byte-aligned buffer (of `shape`, zero-padded at the end of each axis)."""
    out = aligned_empty(shape or x.shape, dtype)
    if out.shape != x.shape:
        out[...] = 0
    out[tuple(slice(0, n) for n in x.shape)] = x
    return out


def aligned_empty(shape: tuple, dtype) -> np.ndarray:
    """np.empty on a 64-byte boundary, which lets device_put on CPU adopt the buffer without a copy."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def write_safetensors(tensors: dict, out_dir: str, max_shard_bytes: int | None = None) -> list[str]:
    """tensors -> out_dir/model.safetensors, or shards model-0000i-of-0000n.safetensors + the index
    (transformers' layout) when they exceed `max_shard_bytes`. Each file is written under a temporary
    name and renamed when complete (a failed export leaves no half-written file). Returns the names."""
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    shards, size = [{}], 0
    for name, x in tensors.items():
        if max_shard_bytes and shards[-1] and size + x.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = x
        size += x.nbytes
    n = len(shards)
    names = [WEIGHTS_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    written = {}
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(out_dir, name + ".tmp"), metadata={"format": "pt"})
        written[name] = shard
    if n > 1:
        index = {
            "metadata": {"total_size": sum(x.nbytes for x in tensors.values())},
            "weight_map": {k: name for name, shard in written.items() for k in shard},
        }
        write_json(index, os.path.join(out_dir, INDEX_FILE), rename=False)
        names.append(INDEX_FILE)
    for name in names:
        os.replace(os.path.join(out_dir, name + ".tmp"), os.path.join(out_dir, name))
    return names


def write_json(data: dict, path: str, rename: bool = True) -> None:
    """path + ".tmp", renamed to path when complete (unless rename=False: the caller renames)."""
    with open(path + ".tmp", "w") as fh:
        json.dump(data, fh, indent=2)
    if rename:
        os.replace(path + ".tmp", path)


def checked_block_size(
    family: str, unsupported: dict, fields: dict, arch_fields, max_len: int, max_len_key: str
) -> int:
    """The checks every imported config gets -> the block_size to use (fields["block_size"] popped).

    `unsupported`: {hf key: its value where flaxgpt cannot run it, else None}; `fields`: the caller's
    GPTConfig overrides, which may not touch what the checkpoint fixes (`arch_fields`); the window may
    shrink below the checkpoint's `max_len` (its config key `max_len_key`) but not grow past it.
    """
    for key, value in unsupported.items():
        if value is not None:
            raise ValueError(f"{family} config with {key}={value!r} is not supported by flaxgpt's GPT")
    for key in fields:
        if key in arch_fields:
            raise ValueError(f"{key} is fixed by the pretrained checkpoint and cannot be overridden")
    block_size = fields.pop("block_size", None) or max_len
    if block_size > max_len:
        raise ValueError(f"block_size {block_size} is longer than the checkpoint's {max_len_key} {max_len}")
    return block_size


def check_names(table, expected: set, what: str, optional=(), ignore=None) -> None:
    """A checkpoint's tensor names are `expected`, plus any of `optional` and names `ignore` matches
    (buffers): otherwise a one-line error "{what}: missing [...] unexpected [...]"."""
    missing = sorted(expected - set(table))
    extra = set(table) - expected - set(optional)
    unexpected = sorted(k for k in extra if not (ignore and ignore.match(k)))
    if missing or unexpected:
        raise ValueError(f"{what}: missing {missing[:5]} unexpected {unexpected[:5]}")


def get_path(tree, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def set_path(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def put_tree(put, tree: dict, path: tuple = ()) -> dict:
    """Every host leaf of a nested dict through put(path, x) (a sharding.Placement's putter)."""
    return {
        k: put_tree(put, v, (*path, k)) if isinstance(v, dict) else put((*path, k), v)
        for k, v in tree.items()
    }
