"""A whole TPU program's v6e estimate from its compiled schedule: the top-level program (`TLP`,
the listing that holds the loops and issues the prefetch DMAs) and every fusion it calls, each
a listing of bundles in the same dump as the Mosaic kernels' (`profiling.v6e.schedule`).

Why not XLA's own `cost_analysis()`: it counts a while loop's body once, whatever its trips (the
layer loop is priced as one layer), and a dynamic slice of stacked weights at the bytes of the
whole stack (checked in tests/test_tpu_schedule.py).

The estimate assumes, beyond `profiling.v6e.schedule`'s assumptions:
- a loop runs as often as its exit test's immediate bound says; a loop whose bound is runtime
  data runs once (reported as `unknown_loops`);
- a loop of the TLP that calls nothing is the copy XLA emits for an argument the caller did not
  donate; the server donates its KV pool, so it does not run;
- within one level of the TLP (the bundles outside any loop, the body of the layer loop) DMAs
  overlap compute: a level costs the larger of its bundles (its own and its callees') at the
  clock and its DMA bytes at HBM bandwidth, once per trip;
- a Pallas kernel is priced by the caller (`kernel_seconds`: the batch's whole use of it, at its
  real steps) and adds to its level once, however many places call it (the branches of a
  conditional: the label gather's streamed kernel, with and without the logsumexp); a kernel the
  caller does not price is read as a fusion.
"""
import dataclasses
import os
import re

from profiling.v6e.chip import V6E, V6eCosts
from profiling.v6e.schedule import Bundle, read_listing

_LISTING = re.compile(r"^\d+-(.+?)-\d+-final_bundles\.txt$")


def read_listings(dump_dir: str) -> dict[str, list[Bundle]]:
    """Every final listing in a dump directory, by HLO instruction name (`TLP` the program)."""
    out = {}
    for fname in sorted(os.listdir(dump_dir)):
        m = _LISTING.match(fname)
        if m and not m.group(1).startswith("<"):
            with open(os.path.join(dump_dir, fname)) as f:
                out[m.group(1)] = read_listing(fname, f.read())
    return out


def loops(bundles: list[Bundle]) -> list[tuple[int, int, int | None]]:
    """(first, last, trips) of each loop: from its `LB` bundle to its back edge (the branch to
    the region the `LB` bundle starts), trips from its exit test (None: a runtime bound)."""
    out = []
    for i, b in enumerate(bundles):
        if not b.loop_start:
            continue
        end = next((j for j in range(i, len(bundles)) if bundles[j].branch
                    and bundles[j].branch[2] in b.regions_started), None)
        if end is not None:
            out.append((i, end, _exit_trips(bundles[i:end + 1])))
    return out


def _exit_trips(body: list[Bundle]) -> int | None:
    """The bound of a counted loop's exit test: the back edge's own `scmp.ge/lt i, N`, or, where
    the test reaches the branch through a select (the TLP's form), the last such test."""
    compares = {p: (cmp, n) for b in body for p, cmp, n in b.compares}
    cmp, n = compares.get(body[-1].branch[1], (None, 0))
    if cmp in ("ge", "lt") and n > 0:
        return n
    tail = [n for b in body[-8:] for _, cmp, n in b.compares if cmp in ("ge", "lt") and n > 0]
    return tail[-1] if tail else None


def _weights(bundles: list[Bundle], skip_callless: bool) -> tuple[list[float], int]:
    """How often each bundle runs, and how many loops have a runtime bound (counted once)."""
    weights, unknown = [1.0] * len(bundles), 0
    for first, last, trips in loops(bundles):
        body = range(first, last + 1)
        if skip_callless and not any(bundles[j].calls for j in body):
            trips = 0
        unknown += trips is None
        for j in body:
            weights[j] *= 1 if trips is None else trips
    return weights, unknown


@dataclasses.dataclass(frozen=True)
class ListingCost:
    bundles: float      # run, loops times their trips
    hbm_bytes: float    # moved by its DMAs whose size the listing states
    unknown_loops: int
    unsized_dmas: float = 0  # run, whose size is a register: their bytes are not counted

    def __add__(self, other: "ListingCost") -> "ListingCost":
        return ListingCost(self.bundles + other.bundles, self.hbm_bytes + other.hbm_bytes,
                           self.unknown_loops + other.unknown_loops,
                           self.unsized_dmas + other.unsized_dmas)


def listing_cost(bundles: list[Bundle]) -> ListingCost:
    weights, unknown = _weights(bundles, skip_callless=False)
    return ListingCost(sum(weights), sum(b.hbm_dma_bytes * w for b, w in zip(bundles, weights)),
                       unknown, sum(b.unsized_dmas * w for b, w in zip(bundles, weights)))


def callee_kernel(hlo_name: str) -> str:
    """A called instruction's name without XLA's `.N` suffix: a Pallas kernel's own name."""
    return re.sub(r"\.\d+$", "", hlo_name)


@dataclasses.dataclass
class Level:
    """The bundles of the TLP that run `trips` times, and what they call."""
    trips: float
    bundles: float = 0
    hbm_bytes: float = 0
    calls: dict = dataclasses.field(default_factory=dict)  # name -> ListingCost, per trip

    def xla_calls(self, kernel_seconds: dict[str, float]) -> dict:
        """The callees that are not in `kernel_seconds` (by `pallas_call` name, without XLA's
        `.N` suffix): XLA's own fusions, priced by their listings."""
        return {name: cost for name, cost in self.calls.items()
                if callee_kernel(name) not in kernel_seconds}

    @staticmethod
    def sized_calls(calls: dict[str, ListingCost],
                    hlo_bytes: dict[str, float] | None = None) -> list[ListingCost]:
        """The callees' costs, each with DMAs whose size is a register moving what
        `hlo_bytes` (its HLO's reads and writes, profiling.v6e.hlo_ops) says, where more."""
        return [dataclasses.replace(cost, hbm_bytes=max(cost.hbm_bytes, hlo_bytes[name]))
                if cost.unsized_dmas and name in (hlo_bytes or {}) else cost
                for name, cost in calls.items()]

    def xla_cost(self, kernel_seconds: dict[str, float],
                 hlo_bytes: dict[str, float] | None = None) -> ListingCost:
        """One trip's bundles and DMA bytes outside the priced kernels: the TLP's own and its
        XLA callees' (`sized_calls`)."""
        return sum(self.sized_calls(self.xla_calls(kernel_seconds), hlo_bytes),
                   ListingCost(self.bundles, self.hbm_bytes, 0))

    def kernels_seconds(self, kernel_seconds: dict[str, float]) -> float:
        called = {callee_kernel(name) for name in self.calls}
        return sum(kernel_seconds[kernel] for kernel in called if kernel in kernel_seconds)

    def seconds(self, kernel_seconds: dict[str, float], costs: V6eCosts = V6E,
                hlo_bytes: dict[str, float] | None = None) -> float:
        """One trip: the callees in `kernel_seconds` at those prices; the TLP's own bundles
        and DMAs, and each XLA callee one after the other, each its own bundles' and DMAs'
        overlap plus an XLA op's fixed cost."""
        xla = self.xla_calls(kernel_seconds)
        return (costs.overlapped(self.bundles, self.hbm_bytes)
                + sum(costs.overlapped(c.bundles, c.hbm_bytes) + costs.xla_op_s
                      for c in self.sized_calls(xla, hlo_bytes))
                + self.kernels_seconds(kernel_seconds))

    @property
    def unknown_loops(self) -> int:
        return sum(cost.unknown_loops for cost in self.calls.values())


def program_levels(listings: dict[str, list[Bundle]]) -> list[Level]:
    """The TLP's levels by how often they run, fewest first."""
    tlp = listings["TLP"]
    weights, _ = _weights(tlp, skip_callless=True)
    levels: dict[float, Level] = {}
    for b, w in zip(tlp, weights):
        if w == 0:
            continue
        level = levels.setdefault(w, Level(w))
        level.bundles += 1
        level.hbm_bytes += b.hbm_dma_bytes
        for name in b.calls:
            if name in listings:
                cost = listing_cost(listings[name])
                level.calls[name] = level.calls[name] + cost if name in level.calls else cost
    return sorted(levels.values(), key=lambda level: level.trips)


def program_seconds(levels: list[Level], kernel_seconds: dict[str, float],
                    costs: V6eCosts = V6E, hlo_bytes: dict[str, float] | None = None) -> float:
    return sum(level.trips * level.seconds(kernel_seconds, costs, hlo_bytes)
               for level in levels)


def level_to_json(level: Level) -> dict:
    return dataclasses.asdict(level)


def level_from_json(d: dict) -> Level:
    return Level(d["trips"], d["bundles"], d["hbm_bytes"],
                 {k: ListingCost(**v) for k, v in d["calls"].items()})
