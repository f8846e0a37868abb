"""The units waiting for a forward, and the order a forward considers them in (CONTRACT §5).

`fcfs`: units in arrival order, so a request of many units holds every request behind it
until its last unit has run. `fair`: requests least recently served go first (those never
served first, ties in arrival order), so a request that arrives behind a large one is
considered first for the next forward, and the large one gets a turn at least once in every
(waiting requests) forwards. Requests that arrive together and fit in one forward are taken in
arrival order under both policies. A request's own units always run in order, so the first one
caches the query's pages and the others reuse them.
"""
import collections
from typing import Iterator

from runtime.job import Job, Unit

SCHEDULE_POLICIES = ("fair", "fcfs")


class WaitQueue:
    def __init__(self, policy: str):
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule policy must be one of {SCHEDULE_POLICIES}, got {policy!r}")
        self.policy = policy
        self._units: dict[Job, collections.deque[Unit]] = {}  # in arrival order
        self._last_served: dict[Job, int] = {}
        self._forwards = 0

    def add(self, job: Job, units: list[Unit]) -> None:
        self._units.setdefault(job, collections.deque()).extend(units)

    def __bool__(self) -> bool:
        return bool(self._units)

    def __len__(self) -> int:
        return sum(len(units) for units in self._units.values())

    def __iter__(self) -> Iterator[Unit]:
        for units in list(self._units.values()):
            yield from units

    def in_order(self) -> list[Unit]:
        """The waiting units in the order the next forward considers them: it takes them
        (`take`) until the first that does not fit."""
        jobs = list(self._units)
        if self.policy == "fair":
            jobs.sort(key=lambda job: self._last_served.get(job, -1))  # stable: arrival order
        return [unit for job in jobs for unit in self._units[job]]

    def take(self, unit: Unit) -> None:
        """Removes `unit`, the first waiting unit of its job, into the forward being formed."""
        units = self._units[unit.job]
        if units[0] is not unit:
            raise ValueError("a job's units are taken in order")
        units.popleft()
        self._last_served[unit.job] = self._forwards
        if not units:
            self.drop(unit.job)

    def put_back(self, units: list[Unit]) -> None:
        """Returns units taken into a forward that did not run, in the order they were taken,
        to the head of the queue: before the waiting units of their jobs, and their jobs
        before every other job."""
        returned: dict[Job, collections.deque[Unit]] = {}
        for unit in units:
            returned.setdefault(unit.job, collections.deque()).append(unit)
        for job, waiting in self._units.items():
            returned.setdefault(job, collections.deque()).extend(waiting)
        self._units = returned

    def drop(self, job: Job) -> None:
        """Forgets `job`'s waiting units (it was cancelled, failed or answered)."""
        self._units.pop(job, None)
        self._last_served.pop(job, None)

    def forward_formed(self) -> None:
        self._forwards += 1
