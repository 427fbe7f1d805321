"""The LoRA adapters a server holds: names on the host, a few resident in device slots (LRU).

    pool = AdapterPool(read, write, slots=4)      # read(path) -> host weights; write(slot, weights)
    pool.load("sql", "adapters/sql")              # any thread: read and checked, nothing on the device
    adapter = pool.get("sql")                     # a request names it (None: unknown)
    slot = pool.acquire(adapter)                  # engine thread: resident in a slot, or None (all busy)
    pool.release(slot)                            # its request ended
    pool.unload("sql")                            # gone for new requests; running ones keep their slot

Slot 0 is the base (no adapter) and never holds one; slots 1 .. slots-1 hold adapters. `acquire`
returns the adapter's slot if it is resident, else writes it into an empty slot or, failing that,
the least recently used slot no running request holds (`write`: a device write into the stacked
weights, models.multi_lora); when every slot is held, None: the request waits in the queue. Each
resident slot counts the requests holding it; an unloaded adapter's slot is emptied once its last
request ends, and requests that named it before the unload still run with it. All host adapters stay
in memory until unloaded. Nothing here knows the model: serve.launch supplies `read` and `write`.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

_loads = itertools.count(1)


@dataclass(eq=False)
class Adapter:
    name: str
    path: str
    weights: object = field(repr=False)  # host arrays in a slot's layout (read's result)
    loaded: bool = True  # False once unloaded: its slot is emptied when no request holds it
    key: bytes = field(default_factory=lambda: b"adapter:%d" % next(_loads))  # its prefix-cache salt: one
    # per load, so a name unloaded and loaded again with other weights never matches the old blocks


class AdapterPool:
    def __init__(self, read, write, *, slots: int):
        """read(path) -> an adapter's slot weights (ValueError / OSError when it does not fit the base);
        write(slot, weights) puts them in device slot `slot` (called on the engine thread only)."""
        if slots < 2:
            raise ValueError(f"adapter slots must be >= 2 (slot 0 is the base), got {slots}")
        self.read, self.write, self.slots = read, write, slots
        self.lock = threading.Lock()
        self.by_name: dict[str, Adapter] = {}
        self.resident: list[Adapter | None] = [None] * slots  # slot -> adapter (slot 0: the base)
        self.holders = [0] * slots  # running requests per slot
        self.last_used = [0] * slots  # a clock tick per acquire: the least recent is evicted first
        self._tick = 0
        self.swaps = 0  # writes into a slot (a Prometheus-style counter; tests read it)

    # ------------------------------------------------------------ any thread

    def load(self, name: str, path: str) -> Adapter:
        """Read and check the adapter at `path` under `name` (ValueError: a taken or empty name, or an
        adapter that does not fit; OSError: no adapter there). Nothing is registered on failure."""
        if not isinstance(name, str) or not name:
            raise ValueError("an adapter needs a name")
        with self.lock:
            if name in self.by_name:
                raise ValueError(f"an adapter named {name!r} is already loaded; unload it first")
        weights = self.read(path)  # slow (files): outside the lock
        with self.lock:
            if name in self.by_name:  # loaded meanwhile by another request
                raise ValueError(f"an adapter named {name!r} is already loaded; unload it first")
            adapter = self.by_name[name] = Adapter(name, str(path), weights)
        return adapter

    def unload(self, name: str) -> None:
        """New requests no longer find `name` (KeyError if unknown); its slot empties when it is free."""
        with self.lock:
            adapter = self.by_name.pop(name)
            adapter.loaded = False
            for slot, held in enumerate(self.resident):
                if held is adapter and self.holders[slot] == 0:
                    self.resident[slot] = None

    def get(self, name: str) -> Adapter | None:
        with self.lock:
            return self.by_name.get(name)

    def names(self) -> list[str]:
        with self.lock:
            return list(self.by_name)

    def resident_names(self) -> list[str | None]:
        with self.lock:
            return [None if a is None else a.name for a in self.resident]

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
