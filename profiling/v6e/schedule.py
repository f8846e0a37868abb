"""A static TPU v6e cost model for Pallas kernels, read from the TPU compiler's own schedule.

The TensorCore issues one VLIW bundle per cycle, in order, and the compiler writes the final
bundles of every Mosaic kernel out (`LIBTPU_INIT_ARGS=--xla_jf_dump_to=DIR`, read when libtpu
starts: so the compile runs in a child process, `profiling.v6e.schedule_worker`). From that
listing, per kernel:
- the grid-step loop (the outermost loop, `LB` at depth 1) and the bundles before (prologue)
  and after it (epilogue);
- one grid step: its bundles, with loops inside it counted times their trip counts, and the
  spans a branch can skip (a `pl.when` body the compiler did not predicate), each with its
  bundles and DMA bytes;
- instruction counts of one step by unit (MXU, VPU, EUP transcendentals, XLU cross-lane,
  vector loads and stores, DMA, scalar) and the HBM bytes its DMAs move.

The estimate, `estimate_seconds`, assumes (the chip's rates and fixed costs:
`profiling.v6e.chip`):
- one bundle per cycle at a fixed clock, with no stall other than waiting for DMAs and a
  fixed cost a grid step (fitted on real v6e measurements): the schedule already holds the
  MXU and EUP latencies;
- a step's DMAs overlap the step's compute (the kernels double-buffer), so a step costs the
  larger of its bundles at the clock and its DMA bytes at the HBM bandwidth;
- every span of a step runs unless the caller says how often it is skipped, and every DMA
  listed in a step moves its bytes unless the caller gives the step's bytes;
- the prologue and epilogue run once, and do not overlap anything; nor do the pipeline's fill
  (the first blocks a kernel copies in before its first step) and drain (its last output
  block, written after its last step), where the caller gives their bytes.
A grid of one step compiles without a grid loop (its outermost loop would be read as the grid
loop): compile a kernel with two steps or more, and give the estimate its real steps.
"""
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

from profiling.v6e.chip import V6E, V6eCosts

DMA_GRANULE_BYTES = 32  # `size_in_granules` of a DMA: checked against block sizes in the tests

_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|0)\s+([A-Z]{2})?:?\s*(>*)\s*\{(.*)$")
_OPCODE = re.compile(r"^\s*(?:%[\w.]+\s*=\s*)?([a-z_][\w.]*)")
_BRANCH = re.compile(r"sbr\.rel \((!?)%(\w+)\) target = \$region(\d+)")
_REGION_START = re.compile(r"Start(?:/End empty)? region (\d+)")
_GRANULES = re.compile(r"size_in_granules=\*/(\d+)")
_HBM_ADDRESS = re.compile(r"%(\w+) = (?:scalar_lea\.hbm|inlined_call_operand\.hbm)\b")
_DMA_ENDS = re.compile(r"/\*(?:src|dst)=\*/%(\w+)")
# A program's listing calls a fusion inlined, or (in larger programs) as a call of its address
_CALL = re.compile(r"(?:inlined_call|= call) [^/]*/\* %([\w.-]+) = ")
_COMPARE = re.compile(r"%(\w+) = scmp\.(\w+)\.s32\.totalorder %\w+, (\d+)\b")

UNITS = ("mxu", "vpu", "eup", "xlu", "vector_load", "vector_store", "dma", "scalar")
_EUP = ("vpow2", "vexp", "vlog", "vrcp", "vrsqrt", "vtanh", "vsqrt", "vpop.eup")
_NOT_VPU = ("vsync", "vwait", "vdelay", "vset")


def unit_of(opcode: str) -> str:
    if opcode.startswith(("vmatmul", "vmatpush", "vmatprep")) or ".mrf." in opcode:
        return "mxu"
    if opcode.startswith(_EUP):
        return "eup"
    if ".xlu" in opcode or opcode.startswith(("vperm", "vxlane", "vrot")):
        return "xlu"
    if opcode.startswith("vld"):
        return "vector_load"
    if opcode.startswith("vst"):
        return "vector_store"
    if opcode.startswith("dma"):
        return "dma"
    if opcode.startswith("v") and not opcode.startswith(_NOT_VPU):
        return "vpu"
    return "scalar"


@dataclasses.dataclass(frozen=True)
class Bundle:
    address: int
    depth: int             # loop nesting: 0 outside the grid loop, 1 in it, 2 in a loop in it
    loop_start: bool       # the first bundle of a loop body (`LB`)
    opcodes: tuple[str, ...]
    hbm_dma_bytes: int     # bytes the bundle's DMAs move between HBM and VMEM
    unsized_dmas: int      # HBM DMAs whose size is a register (a clamped edge block, say)
    branch: tuple[bool, str, int] | None  # (negated, predicate, target region)
    regions_started: tuple[int, ...]
    compares: tuple[tuple[str, str, int], ...]  # (predicate, comparison, immediate)
    calls: tuple[str, ...] = ()  # HLO instructions the bundle calls (a program's listing)


def _instructions(text: str) -> list[str]:
    return [s for s in text.split(";;") if s.strip()]


def parse_bundles(listing: str) -> list[Bundle]:
    """The bundles of a `...-final_bundles.txt` listing; a bundle may run over several lines."""
    chunks = []
    for line in listing.splitlines():
        m = _BUNDLE.match(line)
        if m:
            chunks.append([m, line[m.start(4):]])
        elif chunks:
            chunks[-1][1] += "\n" + line
    hbm = set(_HBM_ADDRESS.findall(listing))
    return [_bundle(m, text, hbm) for m, text in chunks]


def _moves_hbm(opcode: str, instruction: str, hbm_registers: set[str]) -> bool:
    """A DMA between HBM and VMEM: named so (`dma.hbm_to_vmem`), or a general (strided) DMA
    whose source or destination register holds an HBM address (`scalar_lea.hbm`)."""
    if opcode == "dma.general":
        ends = _DMA_ENDS.findall(instruction)
        return any(register in hbm_registers for register in ends)
    return opcode.startswith("dma") and "hbm" in opcode


def _bundle(m: re.Match, text: str, hbm_registers: set[str] = frozenset()) -> Bundle:
    body, _, trailer = text.rpartition("}")
    opcodes, dma_bytes, unsized, compares = [], 0, 0, []
    for instruction in _instructions(body):
        op = _OPCODE.match(instruction)
        if not op:
            continue
        opcodes.append(op.group(1))
        if _moves_hbm(op.group(1), instruction, hbm_registers):
            granules = _GRANULES.search(instruction)
            dma_bytes += int(granules.group(1)) * DMA_GRANULE_BYTES if granules else 0
            unsized += granules is None
        compares += [(c.group(1), c.group(2), int(c.group(3)))
                     for c in _COMPARE.finditer(instruction)]
    branch = _BRANCH.search(body)
    return Bundle(
        address=int(m.group(1), 16), depth=len(m.group(3)), loop_start=m.group(2) == "LB",
        opcodes=tuple(opcodes), hbm_dma_bytes=dma_bytes, unsized_dmas=unsized,
        branch=(branch.group(1) == "!", branch.group(2), int(branch.group(3))) if branch else None,
        regions_started=tuple(int(r) for r in _REGION_START.findall(trailer)),
        compares=tuple(compares), calls=tuple(_CALL.findall(body)))


@dataclasses.dataclass(frozen=True)
class Span:
    """Bundles of a grid step that a branch can skip."""
    first: int        # address of its first bundle
    depth: int        # spans it lies in
    bundles: int
    hbm_dma_bytes: int
    end: int = 0      # address of the bundle after it
    dmas: int = 0     # DMA instructions in it (starts and waits)

    def holds(self, other: "Span") -> bool:
        return self.first <= other.first and other.end <= self.end and other != self


@dataclasses.dataclass(frozen=True)
class KernelSchedule:
    name: str
    total_bundles: int     # the listing's bundles, each once
    prologue: int          # before the grid-step loop
    step: int              # one grid step, every span taken, inner loops times their trips
    epilogue: int          # after the grid-step loop
    step_units: dict       # instructions of one grid step by unit (UNITS)
    step_hbm_dma_bytes: int    # of the DMAs with a size in the listing
    step_unsized_dmas: int     # DMAs of a step whose size is runtime data
    spans: tuple[Span, ...]         # skippable spans of a step, nested ones too, in order
    # (bundles per trip, trips or None where the bound is runtime data, DMA bytes per trip)
    inner_loops: tuple[tuple[int, int | None, int], ...]

    def step_bundles(self, skipped: dict[int, float] | None = None,
                     loop_trips: dict[int, float] | None = None) -> float:
        """Bundles of an average step when span i is skipped (and the spans it lies in are
        not) in a fraction skipped[i] of steps, and inner loop j, whose bound is runtime data
        (counted once in `step`), runs loop_trips[j] times."""
        extra = sum((n - 1) * self.inner_loops[j][0] for j, n in (loop_trips or {}).items())
        return self.step + extra - sum(self.spans[i].bundles * f
                                       for i, f in (skipped or {}).items())

    def children(self, i: int) -> list[int]:
        """The spans directly inside span i, in order."""
        return [j for j, span in enumerate(self.spans)
                if span.depth == self.spans[i].depth + 1 and self.spans[i].holds(span)]

    def step_bytes(self, skipped: dict[int, float] | None = None,
                   loop_trips: dict[int, float] | None = None) -> float:
        extra = sum((n - 1) * self.inner_loops[j][2] for j, n in (loop_trips or {}).items())
        return self.step_hbm_dma_bytes + extra - sum(self.spans[i].hbm_dma_bytes * f
                                                     for i, f in (skipped or {}).items())


def _loop_trips(body: list[Bundle]) -> int | None:
    """Trips of an inner loop whose back edge is `sbr.rel (!p)` on `p = scmp.ge i + 1, N`
    (the form Mosaic emits for a counted loop from 0); None for any other form."""
    edge = next((b.branch for b in reversed(body) if b.branch), None)
    if edge is None or not edge[0]:
        return None
    compares = {p: (cmp, n) for b in body for p, cmp, n in b.compares}
    cmp, n = compares.get(edge[1], (None, 0))
    return n if cmp == "ge" and n > 0 else None


def _spans(step: list[Bundle], weights: list[int]) -> tuple[Span, ...]:
    """Forward-branch spans of the step, nested ones included: from the bundle after a branch
    to the bundle that starts its target region."""
    starts = {}
    for i, b in enumerate(step):
        for r in b.regions_started:
            starts.setdefault(r, i)
    spans, open_ends = [], []
    for i, b in enumerate(step):
        open_ends = [e for e in open_ends if e > i]
        target = starts.get(b.branch[2]) if b.branch else None
        if target is None or target <= i + 1:
            continue
        body = range(i + 1, target)
        spans.append(Span(step[i + 1].address, len(open_ends), sum(weights[j] for j in body),
                          sum(step[j].hbm_dma_bytes * weights[j] for j in body),
                          step[target].address,
                          sum(unit_of(op) == "dma" for j in body for op in step[j].opcodes)))
        open_ends.append(target)
    return tuple(spans)


def schedule_of(name: str, total_bundles: int, bundles: list[Bundle]) -> KernelSchedule:
    """Read one kernel's listing as prologue, grid step (weighted by inner-loop trips),
    epilogue."""
    first = next((i for i, b in enumerate(bundles) if b.loop_start and b.depth == 1), None)
    if first is None:  # no grid loop: a single-step kernel
        first = len(bundles)
    last = max((i for i, b in enumerate(bundles) if b.depth >= 1), default=first - 1)
    step = bundles[first:last + 1]
    weights, loops, i = [1] * len(step), [], 0
    while i < len(step):
        if step[i].depth >= 2:
            j = i
            while j < len(step) and step[j].depth >= 2:
                j += 1
            trips = _loop_trips(step[i:j])
            loops.append((j - i, trips, sum(b.hbm_dma_bytes for b in step[i:j])))
            weights[i:j] = [trips or 1] * (j - i)
            i = j
        else:
            i += 1
    units = collections.Counter({u: 0 for u in UNITS})
    for b, w in zip(step, weights):
        for op in b.opcodes:
            units[unit_of(op)] += w
    return KernelSchedule(
        name=name, total_bundles=total_bundles, prologue=first, step=sum(weights),
        epilogue=len(bundles) - last - 1, step_units=dict(units),
        step_hbm_dma_bytes=sum(b.hbm_dma_bytes * w for b, w in zip(step, weights)),
        step_unsized_dmas=sum(b.unsized_dmas * w for b, w in zip(step, weights)),
        spans=_spans(step, weights), inner_loops=tuple(loops))


def estimate_seconds(schedule: KernelSchedule, steps: int, costs: V6eCosts = V6E, *,
                     skipped: dict[int, float] | None = None,
                     step_bytes: float | None = None,
                     loop_trips: dict[int, float] | None = None,
                     fill_bytes: float = 0.0, drain_bytes: float = 0.0) -> float:
    """`steps` grid steps at the larger of compute and DMA time, each with the chip's fixed
    cost of a grid step, plus prologue and epilogue.
    `skipped` and `loop_trips` as in `KernelSchedule.step_bundles`. `step_bytes` replaces the
    listing's DMA bytes per step where the caller knows better: a DMA the compiler predicated
    instead of branching around (the first step's prefetch, say) is listed in every step.
    `fill_bytes` and `drain_bytes` of the steps' bytes are the pipeline's fill (its first
    blocks, copied in before the first step) and drain (its last output block, written after
    the last): taken out of the steps' share and costed alone, with nothing to overlap
    them."""
    if step_bytes is None:
        if schedule.step_unsized_dmas:
            raise ValueError(f"{schedule.name}: {schedule.step_unsized_dmas} DMAs a step have "
                             "a runtime size: pass step_bytes")
        step_bytes = schedule.step_bytes(skipped, loop_trips)
    overlapped = max(step_bytes - (fill_bytes + drain_bytes) / steps, 0.0)
    per_step = costs.overlapped(schedule.step_bundles(skipped, loop_trips), overlapped)
    return (steps * (per_step + costs.grid_step_s)
            + (schedule.prologue + schedule.epilogue) / costs.clock_hz
            + (fill_bytes + drain_bytes) / costs.hbm_bytes_per_s)


_TOTAL = re.compile(r"total scheduled bundles:\s*(\d+)")
_LISTING = re.compile(r"^\d+-(.+?)(?:\.\d+)?-\d+-final_bundles\.txt$")


def read_dumps(dump_dir: str) -> dict[str, KernelSchedule]:
    """Every Mosaic kernel's schedule in a dump directory, by `pallas_call` name."""
    files = sorted(os.listdir(dump_dir))
    out = {}
    for fname in files:
        m = _LISTING.match(fname)
        if not m or m.group(1).startswith(("<", "TLP")):
            continue
        with open(os.path.join(dump_dir, fname)) as f:
            bundles = read_listing(fname, f.read())
        prefix = fname[:m.end(1)]
        analysis = [a for a in files if a.startswith(prefix)
                    and a.endswith("schedule-analysis_final_bundles.txt")]
        if analysis:
            with open(os.path.join(dump_dir, analysis[0])) as f:
                check_total(fname, f.read(), len(bundles))
        out[m.group(1)] = schedule_of(m.group(1), len(bundles), bundles)
    return out


def read_listing(name: str, listing: str) -> list[Bundle]:
    """A listing's bundles; one with none is not a listing this reader knows: refused."""
    bundles = parse_bundles(listing)
    if not bundles:
        raise ValueError(f"{name}: no bundles read from its listing ({len(listing)} "
                         f"characters): not a form this reader knows, so no estimate")
    return bundles


def check_total(name: str, analysis: str, bundles: int) -> None:
    """Where the compiler's schedule analysis states its total bundles (not every one does: a
    program with a while loop has some without), the listing read must hold as many."""
    total = _TOTAL.search(analysis)
    if total and int(total.group(1)) != bundles:
        raise ValueError(f"{name}: {bundles} bundles read, the compiler's analysis says "
                         f"{total.group(1)}: the listing was misread, so no estimate")


# Only the final listings, and none of the annotations the packer keeps for other dumps: the
# same machine code either way, in 0.4-0.6 of the compile time for a large kernel
# (docs/tpu_v6e.md, "Things to know").
_DUMP_FLAGS = ("--xla_jf_dump_llo_pass_label_regex=final_bundles",
               "--xla_jf_emit_annotations=false")


def compile_schedules(builder: str, cases: list[dict], timeout_s: float = 600,
                      program: bool = False, keep_going: bool = False) -> list[dict]:
    """Compile `builder(**case)` -> (fn, args) for one v6e chip in a child process whose libtpu
    dumps its schedules, one case after another. Per case: {"kernels": {name:
    KernelSchedule}, "xla": the program's cost_analysis() flops, bytes and optimal_seconds,
    "levels": with `program`, the whole program's levels as JSON (profiling.v6e.program_schedule.
    level_from_json), else None, "hlo": with `program`, its optimized HLO text}; with
    `keep_going`, a case that fails gives {"error": why} instead of stopping the others.
    `builder` is "module:function", importable from the repository root."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, LIBTPU_INIT_ARGS=" ".join(filter(None, (
            os.environ.get("LIBTPU_INIT_ARGS"), f"--xla_jf_dump_to={tmp}/dumps", *_DUMP_FLAGS))),
            TPU_ACCELERATOR_TYPE=os.environ.get("TPU_ACCELERATOR_TYPE", "v6e-4"),
            ALLOW_MULTIPLE_LIBTPU_LOAD="1")  # this process may hold libtpu too; no TPU here
        out = os.path.join(tmp, "schedules.json")
        request = json.dumps({"builder": builder, "cases": cases, "dump_dir": f"{tmp}/dumps",
                              "out": out, "program": program, "keep_going": keep_going})
        done = subprocess.run([sys.executable, "-m", "profiling.v6e.schedule_worker"],
                              input=request, text=True, capture_output=True, env=env,
                              timeout=timeout_s, cwd=_repository_root())
        if done.returncode != 0:
            raise RuntimeError(f"compiling {builder} for v6e failed:\n{done.stderr[-4000:]}")
        with open(out) as f:
            results = json.load(f)
    return [r if "error" in r else
            {**r, "kernels": {k: schedule_from_json(v) for k, v in r["kernels"].items()}}
            for r in results]


def _repository_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def schedule_to_json(s: KernelSchedule) -> dict:
    return dataclasses.asdict(s)


def schedule_from_json(d: dict) -> KernelSchedule:
    return KernelSchedule(**{**d, "spans": tuple(Span(**s) for s in d["spans"]),
                             "inner_loops": tuple(tuple(x) for x in d["inner_loops"])})
