"""The LoRA adapters a server holds: names on the host, a few resident in device slots (LRU).

    pool = AdapterPool(read, write, slots=4)      # read(path) -> host weights; write(slot, weights)
    pool.load("sql", "adapters/sql")              # start-up (the operator's path): read and checked
    pool = AdapterPool(read, write, slots=4, runtime_root="adapters", max_host=8)
    pool.load_under_root("poems", "poems")        # a client's path: only inside runtime_root
    adapter = pool.get("sql")                     # a request names it (None: unknown or evicted)
    adapter = pool.reload("sql")                  # evicted from host memory (max_host): read again
    slot = pool.acquire(adapter)                  # engine thread: resident in a slot, or None (all busy)
    pool.release(slot)                            # its request ended
    pool.unload("sql")                            # gone for new requests; running ones keep their slot

Slot 0 is the base (no adapter) and never holds one; slots 1 .. slots-1 hold adapters. `acquire`
returns the adapter's slot if it is resident, else writes it into an empty slot or, failing that,
the least recently used slot no running request holds (`write`: a device write into the stacked
weights, models.multi_lora); when every slot is held, None: the request waits in the queue. Each
resident slot counts the requests holding it; an unloaded adapter's slot is emptied once its last
request ends, and requests that named it before the unload still run with it.

Host memory: with `max_host`, at most that many adapters keep their weights on the host; loading or
reloading one more drops the least recently requested one that is not resident in a device slot (a
resident one's weights are needed to write it back after its slot is taken). The name stays served:
`reload` reads it again from where it was loaded (a runtime path is checked against the root again),
with a new prefix-cache key since the files may have changed. A queued request holding the dropped
Adapter still runs with it: the pool only lets go of its reference. When every other adapter is
resident the pool holds one over `max_host` until one leaves its slot.

Runtime loads are a privilege (serve.py --allow_runtime_lora): `load_under_root` reads only inside
`runtime_root` (`..` refused, symlinks followed and the result checked), and its errors name the
client's path, never the server's. Nothing here knows the model: serve.launch supplies `read` and
`write`.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

_loads = itertools.count(1)


@dataclass(eq=False)
class Adapter:
    name: str
    path: str
    weights: object = field(repr=False)  # host arrays in a slot's layout (read's result)
    loaded: bool = True  # False once unloaded: its slot is emptied when no request holds it
    key: bytes = field(default_factory=lambda: b"adapter:%d" % next(_loads))  # its prefix-cache salt: one
    # per load, so a name unloaded and loaded again with other weights never matches the old blocks


class PathRefused(ValueError):
    """A runtime lora_path outside the adapter root, or not there (the message names no server path)."""


def under_root(root: Path, path: str) -> Path:
    """`path` (relative to `root`, or absolute inside it) as the real directory it names, which must lie
    inside the real `root`. PathRefused for '..', a path or symlink that leads out, or nothing there."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise PathRefused("lora_path must be a non-empty string")
    if ".." in Path(path).parts:  # refused even when it would come back inside: nobody needs it
        raise PathRefused(f"lora_path {path!r} contains '..': give a path inside the adapter root")
    try:
        real = (root / path).resolve()  # an absolute path replaces root; symlinks followed
    except (OSError, RuntimeError):  # a symlink loop, a name too long
        raise PathRefused(f"not found under the adapter root (lora_path {path!r})") from None
    if not real.is_relative_to(root):  # checked after resolving: a symlink inside may point out
        raise PathRefused(f"lora_path {path!r} leads outside the adapter root: give a path inside it")
    if not real.is_dir():
        raise PathRefused(f"not found under the adapter root (lora_path {path!r})")
    return real


class AdapterPool:
    def __init__(self, read, write, *, slots: int, runtime_root=None, max_host: int | None = None):
        """read(path) -> an adapter's slot weights (ValueError / OSError when it does not fit the base);
        write(slot, weights) puts them in device slot `slot` (called on the engine thread only).
        runtime_root: the directory load_under_root reads from (None: runtime loads are refused);
        max_host: adapters whose weights stay in host memory (None: all)."""
        if slots < 2:
            raise ValueError(f"adapter slots must be >= 2 (slot 0 is the base), got {slots}")
        if max_host is not None and max_host < slots - 1:
            raise ValueError(
                f"max_host {max_host} is below the {slots - 1} adapter slots: every resident adapter "
                f"stays in host memory; give at least {slots - 1}"
            )
        if runtime_root is not None and not os.path.isdir(runtime_root):
            raise ValueError(f"the adapter root {runtime_root} is not a directory: give an existing one")
        self.read, self.write, self.slots, self.max_host = read, write, slots, max_host
        self.root = None if runtime_root is None else Path(runtime_root).resolve()
        self.lock = threading.Lock()
        self.served: dict[str, tuple[str, bool]] = {}  # name -> (path, under the root?), in load order
        self.held: OrderedDict[str, Adapter] = OrderedDict()  # weights on the host, least recent first
        self.resident: list[Adapter | None] = [None] * slots  # slot -> adapter (slot 0: the base)
        self.holders = [0] * slots  # running requests per slot
        self.last_used = [0] * slots  # a clock tick per acquire: the least recent is evicted first
        self._tick = 0
        self.swaps = 0  # writes into a slot (a Prometheus-style counter; tests read it)
        self.evictions = 0  # adapters dropped from host memory (max_host)

    # ------------------------------------------------------------ any thread

    def load(self, name: str, path: str) -> Adapter:
        """Read and check the adapter at `path` (the operator's: any path) under `name` (ValueError: a
        taken or empty name, or an adapter that does not fit; OSError: no adapter there)."""
        return self._add(name, str(path), runtime=False)

    def load_under_root(self, name: str, path: str) -> Adapter:
        """A client's load: `path` must lie inside runtime_root (PermissionError when there is none).
        ValueError for everything else, its message naming `path` as given, never the resolved one."""
        if self.root is None:
            raise PermissionError("this pool has no runtime_root: runtime loads are off")
        return self._add(name, path, runtime=True)

    def reload(self, name: str) -> Adapter | None:
        """The adapter `name` again after max_host evicted it (slow: its files are read); None when no
        adapter of that name is served. OSError / ValueError when it can no longer be read."""
        with self.lock:
            if name in self.held:
                return self._touch(name)
            if name not in self.served:
                return None
            path, runtime = self.served[name]
        weights = self._read(path, runtime)
        with self.lock:
            if name in self.held:  # reloaded meanwhile by another request
                return self._touch(name)
            if self.served.get(name) != (path, runtime):  # unloaded (or replaced) meanwhile
                return None
            return self._hold(Adapter(name, path, weights))

    def unload(self, name: str) -> None:
        """New requests no longer find `name` (KeyError if unknown); its slot empties when it is free."""
        with self.lock:
            del self.served[name]
            adapter = self.held.pop(name, None)
            if adapter is None:  # evicted from host memory, so in no slot (unless a queued request that
                return  # held it has since written it: that slot is reused by LRU like any other)
            adapter.loaded = False
            for slot, held in enumerate(self.resident):
                if held is adapter and self.holders[slot] == 0:
                    self.resident[slot] = None

    def get(self, name: str) -> Adapter | None:
        """The adapter a request names, now the most recently used (None: unknown, or evicted: see
        `reload`). Never reads files."""
        with self.lock:
            return self._touch(name) if name in self.held else None

    def names(self) -> list[str]:
        """Every adapter served, in load order (evicted ones too: a request reloads them)."""
        with self.lock:
            return list(self.served)

    def host_names(self) -> list[str]:
        """The adapters whose weights are in host memory, least recently used first."""
        with self.lock:
            return list(self.held)

    def resident_names(self) -> list[str | None]:
        with self.lock:
            return [None if a is None else a.name for a in self.resident]

    def _add(self, name, path, runtime) -> Adapter:
        if not isinstance(name, str) or not name:
            raise ValueError("an adapter needs a name")
        with self.lock:
            if name in self.served:
                raise ValueError(f"an adapter named {name!r} is already loaded; unload it first")
        weights = self._read(path, runtime)  # slow (files): outside the lock
        with self.lock:
            if name in self.served:  # loaded meanwhile by another request
                raise ValueError(f"an adapter named {name!r} is already loaded; unload it first")
            self.served[name] = (path, runtime)
            return self._hold(Adapter(name, path, weights))

    def _read(self, path, runtime):
        if not runtime:
            return self.read(path)
        real = under_root(self.root, path)
        try:
            return self.read(str(real))
        except Exception as e:  # its message names the real path: say the client's instead
            message = str(e).replace(str(real), path).replace(str(self.root), "<adapter root>")
            raise ValueError(message) from None

    def _touch(self, name) -> Adapter:  # under the lock
        self.held.move_to_end(name)
        return self.held[name]

    def _hold(self, adapter) -> Adapter:  # under the lock: newest, then evict the least recent over max_host
        self.held[adapter.name] = adapter
        if self.max_host is None:
            return adapter
        for name in [n for n, a in self.held.items() if a is not adapter and a not in self.resident]:
            if len(self.held) <= self.max_host:
                break
            del self.held[name]
            self.evictions += 1
        return adapter

    # ------------------------------------------------------------ the engine thread

    def acquire(self, adapter: Adapter | None) -> int | None:
        """The slot `adapter` decodes in, now held by one more request (None adapter: slot 0, the base);
        None when it is not resident and every slot is held by running requests."""
        if adapter is None:
            return 0
        with self.lock:
            self._tick += 1
            if adapter in self.resident:
                slot = self.resident.index(adapter)
            else:
                free = [s for s in range(1, self.slots) if self.holders[s] == 0]
                if not free:
                    return None
                empty = [s for s in free if self.resident[s] is None]
                slot = empty[0] if empty else min(free, key=lambda s: self.last_used[s])
                self.resident[slot] = None  # while written: no one finds a half-written slot
                self.write(slot, adapter.weights)
                self.resident[slot] = adapter
                self.swaps += 1
            self.holders[slot] += 1
            self.last_used[slot] = self._tick
            return slot

    def release(self, slot: int) -> None:
        if slot == 0:
            return
        with self.lock:
            self.holders[slot] -= 1
            adapter = self.resident[slot]
            if self.holders[slot] == 0 and adapter is not None and not adapter.loaded:
                self.resident[slot] = None
