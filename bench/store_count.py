"""A c10d Store that counts what passes through it: requests and payload bytes per operation, for the scale benches.

    python bench/scale_gloo.py --worlds 64,256,1024,2048 --out /tmp/g.json   # one user (also bench/scale_coord.py)

CountingStore wraps a real store (a TCPStore client, as every rank holds one) and forwards every call; gloo and the
project's code see an ordinary Store (a Python subclass of dist.Store, which c10d and gloo call through). Bytes are
keys plus values as sent or received: the payload, not TCP framing. `has_extended_api` is not forwarded, so gloo
reads peers with one `wait` + `get` per key, as it does on torchrun's store unless GLOO_ENABLE_STORE_V2_API is set.
"""

from __future__ import annotations

import collections
import threading

import torch.distributed as dist


class CountingStore(dist.Store):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.requests: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def _count(self, op: str, nbytes: int) -> None:
        with self._lock:
            self.requests[op] += 1
            self.bytes[op] += nbytes

    def totals(self) -> dict:
        """{"requests": n, "bytes": n, "by_op": {op: n}} so far."""
        with self._lock:
            return {"requests": sum(self.requests.values()), "bytes": sum(self.bytes.values()),
                    "by_op": dict(self.requests)}

    def set(self, key, value):
        value = value if isinstance(value, (bytes, bytearray)) else str(value).encode()
        self._count("set", len(key) + len(value))
        return self.inner.set(key, value)

    def get(self, key):
        value = self.inner.get(key)
        self._count("get", len(key) + len(value))
        return value

    def add(self, key, amount):
        self._count("add", len(key) + 8)
        return self.inner.add(key, amount)

    def check(self, keys):
        self._count("check", sum(map(len, keys)))
        return self.inner.check(keys)

    def wait(self, keys, *timeout):
        self._count("wait", sum(map(len, keys)))
        return self.inner.wait(keys, *timeout)

    def compare_set(self, key, expected, desired):
        self._count("compare_set", len(key) + len(expected) + len(desired))
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        self._count("delete_key", len(key))
        return self.inner.delete_key(key)

    def num_keys(self):
        self._count("num_keys", 0)
        return self.inner.num_keys()

    def multi_get(self, keys):
        values = self.inner.multi_get(keys)
        self._count("multi_get", sum(map(len, keys)) + sum(map(len, values)))
        return values

    def multi_set(self, keys, values):
        self._count("multi_set", sum(map(len, keys)) + sum(map(len, values)))
        return self.inner.multi_set(keys, values)

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)

    @property
    def timeout(self):
        return self.inner.timeout
