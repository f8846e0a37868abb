"""Data parallel routing: which replica (scheduler) takes a request.

A query goes back to the replica that took it last, whose prefix cache likely still holds it,
unless that replica has more than `slack_tokens` more work queued than the least loaded one;
then, like a new query, it goes to the least loaded one (ties taken in turn).
"""
import collections
import threading
from typing import Hashable, Sequence


class Router:
    def __init__(self, schedulers: Sequence, slack_tokens: int, capacity: int = 4096):
        self.schedulers, self.slack_tokens, self.capacity = schedulers, slack_tokens, capacity
        self.affine_routes = 0  # requests sent to their query's replica
        self._homes: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
        self._turn = 0
        self._lock = threading.Lock()

    def pick(self, key: Hashable | None) -> int:
        """The replica for a request whose shareable prefix is `key` (None: nothing shared)."""
        if len(self.schedulers) == 1:
            return 0
        loads = [s.load for s in self.schedulers]
        with self._lock:
            home = self._homes.get(key) if key is not None else None
            if home is not None and loads[home] <= min(loads) + self.slack_tokens:
                self._homes.move_to_end(key)
                self.affine_routes += 1
                return home
            chosen = self._least_loaded(loads)
            if key is not None:
                self._remember(key, chosen)
            return chosen

    def _least_loaded(self, loads: list[int]) -> int:
        n = len(loads)
        self._turn = (self._turn + 1) % n
        order = [(self._turn + i) % n for i in range(n)]
        return min(order, key=loads.__getitem__)

    def _remember(self, key: Hashable, replica: int) -> None:
        self._homes[key] = replica
        self._homes.move_to_end(key)
        if len(self._homes) > self.capacity:
            self._homes.popitem(last=False)
