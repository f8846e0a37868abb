"""The v6e estimate held against real v6e measurements: each case of a case file
(profiling.v6e.measured_cases) compiled here for one v6e chip, its program estimated as the
forward's estimate is (its Pallas kernels at their real grid steps, its XLA ops by their
listings), and printed beside what the chip measured.

python -m profiling.v6e.against_measured [--cases FILE] [--schedules FILE] [--only REGEX]
    [--stand_in] [--out FILE]
Per case: the estimate (kernels and XLA ops apart) and the measurement (median of its
samples), and their ratio; then per program and split, the ratio's median, quartiles and range.
--schedules keeps what the compiler said of each case in a JSON file, read back on the next
run instead of compiling again (`--norecompile` refuses to compile what it lacks).
Compiling: tokamax's own programs where tokamax is installed, else JAX's closest
(profiling.v6e.measured_programs; --stand_in forces those).
"""
import dataclasses
import json
import os
import re
import statistics

import numpy as np
from absl import app, flags

from profiling.timing import write_json
from profiling.v6e.chip import V6E, V6eCosts
from profiling.v6e.hlo_ops import op_facts
from profiling.v6e.measured_cases import CASE_FILE, MeasuredCase, load_cases
from profiling.v6e.measured_programs import FLASH, splash_runs, tokamax_installed
from profiling.v6e.program_schedule import level_from_json, program_seconds
from profiling.v6e.schedule import (
    compile_schedules,
    estimate_seconds,
    schedule_from_json,
    schedule_to_json,
)
from runtime.cli_flags import parse_flags

FLAGS = flags.FLAGS
_BATCH = 8  # cases a compiling child process takes


def define_flags() -> None:
    flags.DEFINE_string("cases", CASE_FILE, "the case file")
    flags.DEFINE_string("schedules", None, "keep the compiled cases' schedules in this JSON "
                        "file, and read those it holds instead of compiling again")
    flags.DEFINE_bool("recompile", True, "compile the cases the schedules file lacks")
    flags.DEFINE_string("only", None, "only the cases whose name matches this regex")
    flags.DEFINE_bool("stand_in", False, "compile JAX's closest programs, not tokamax's")
    flags.DEFINE_bool("fit", False, "fit the chip's clock, HBM rate and fixed costs on the "
                      "fit split's cases of --fit_programs, and price every case with them")
    flags.DEFINE_list("fit_programs", [FLASH], "the programs whose fit cases the constants "
                      "are fitted on (the XLA-only programs' misses are not the chip's: "
                      "docs/tpu_v6e.md)")
    flags.DEFINE_string("out", None, "write every case's figures as JSON here")


def compiled_cases(cases: list[MeasuredCase], stand_in: bool, schedules: str | None = None,
                   recompile: bool = True) -> dict[str, dict]:
    """What the compiler says of each case (`compile_schedules` with the program's levels),
    by name, as JSON; read from and written to `schedules` where given."""
    known = {}
    if schedules and os.path.exists(schedules):
        with open(schedules) as f:
            known = json.load(f)
    missing = [c for c in cases if c.name not in known]
    if missing and not recompile:
        raise ValueError(f"{len(missing)} cases are not in {schedules}, e.g. {missing[0].name}")
    for start in range(0, len(missing), _BATCH):
        batch = missing[start:start + _BATCH]
        results = compile_schedules(
            "profiling.v6e.measured_programs:build",
            [dict(program=c.program, arguments=c.arguments, config=c.config, stand_in=stand_in)
             for c in batch], timeout_s=3600, program=True, keep_going=True)
        for case, result in zip(batch, results):
            known[case.name] = {"stand_in": stand_in, **(result if "error" in result else {
                **result, "kernels": {k: schedule_to_json(s)
                                      for k, s in result["kernels"].items()}})}
        if schedules:
            with open(schedules, "w") as f:
                json.dump(known, f)
    return {c.name: known[c.name] for c in cases}


@dataclasses.dataclass(frozen=True)
class CaseParts:
    """What a case's estimate is made of, to price at any chip costs: its Pallas kernels with
    how their grids run, the program's levels, and its XLA ops' HLO bytes."""
    case: MeasuredCase
    kernels: dict          # name -> (KernelSchedule, KernelRuns)
    levels: list
    hlo_bytes: dict

    @property
    def steps(self) -> int:
        return sum(runs.steps for _, runs in self.kernels.values())

    @property
    def xla_ops(self) -> float:
        """XLA ops run: each level's callees outside the kernels, times its trips."""
        return sum(level.trips * len(level.xla_calls(self.kernels)) for level in self.levels)

    def kernel_seconds(self, costs: V6eCosts) -> dict[str, float]:
        return {name: estimate_seconds(schedule, runs.steps, costs, skipped=runs.skipped,
                                       step_bytes=runs.step_bytes, fill_bytes=runs.fill_bytes,
                                       drain_bytes=runs.drain_bytes)
                for name, (schedule, runs) in self.kernels.items()}

    def seconds(self, costs: V6eCosts) -> tuple[float, float]:
        """The kernels' and the whole program's estimates."""
        kernels = self.kernel_seconds(costs)
        return sum(kernels.values()), program_seconds(self.levels, kernels, costs,
                                                      self.hlo_bytes)


def case_parts(case: MeasuredCase, result: dict) -> CaseParts:
    kernels = {}
    for name, schedule_json in result["kernels"].items():
        if case.program != FLASH:
            raise ValueError(f"{case.name}: no grid known for kernel {name} of {case.program}")
        schedule = schedule_from_json(schedule_json)
        kernels[name] = (schedule, splash_runs(case.arguments, case.config, schedule,
                                               result["stand_in"]))
    facts = op_facts(result["hlo"])
    return CaseParts(case, kernels, [level_from_json(x) for x in result["levels"]],
                     {name: f.hbm_bytes for name, f in facts.items()})


def case_row(parts: CaseParts, costs: V6eCosts = V6E) -> dict:
    """The case's estimate beside its measurement."""
    case = parts.case
    kernel_s, total = parts.seconds(costs)
    return {"name": case.name, "split": case.split, "program": case.program,
            "steps": parts.steps, "xla_ops": parts.xla_ops, "kernel_s": kernel_s,
            "xla_s": total - kernel_s, "estimate_s": total, "measured_s": case.measured_s,
            "ratio": total / case.measured_s}


def fit(parts: list[CaseParts], clocks=np.arange(1.50e9, 2.101e9, 0.01e9),
        rates=np.arange(1.00e12, 1.801e12, 0.02e12)) -> tuple[V6eCosts, float]:
    """The chip costs that make the estimates of `parts` nearest their measurements (least
    squares of the relative error): for each clock and HBM rate on a grid, the grid step's
    and the XLA op's fixed costs (not negative) by linear least squares. The costs, and the
    root mean square relative error."""
    measured = np.array([p.case.measured_s for p in parts])
    counts = np.array([[p.steps, p.xla_ops] for p in parts], float) / measured[:, None]
    best = (np.inf, None)
    for clock in clocks:
        for rate in rates:
            base = V6eCosts(float(clock), float(rate), 0.0, 0.0)
            miss = np.array([p.seconds(base)[1] for p in parts]) / measured - 1
            fixed = _nonnegative_least_squares(counts, -miss)
            error = float(np.sqrt(np.mean((miss + counts @ fixed) ** 2)))
            if error < best[0]:
                best = (error, V6eCosts(float(clock), float(rate), *map(float, fixed)))
    return best[1], best[0]


def _nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """x >= 0 minimizing |a x - b| for a's two columns: the unconstrained solution, else the
    better of each column alone (clamped at 0)."""
    x = np.linalg.lstsq(a, b, rcond=None)[0]
    if (x >= 0).all():
        return x
    candidates = [np.zeros(2)]
    for j in range(2):
        xj = np.zeros(2)
        xj[j] = max(float(a[:, j] @ b) / max(float(a[:, j] @ a[:, j]), 1e-30), 0.0)
        candidates.append(xj)
    return min(candidates, key=lambda c: float(np.sum((a @ c - b) ** 2)))


def spread(ratios: list[float]) -> dict:
    if len(ratios) < 2:
        return {"n": len(ratios), "median": ratios[0] if ratios else None}
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return {"n": len(ratios), "median": median, "q1": q1, "q3": q3, "min": min(ratios),
            "max": max(ratios)}


def summary(rows: list[dict]) -> dict:
    """The ratio's spread per program and split, over the XLA-only programs' cases (no Pallas
    kernel), and over all cases."""
    groups = {}
    for row in rows:
        kinds = [row["program"], "all"] + (["XLA-only programs"] if not row["steps"] else [])
        for kind in kinds:
            for split in (row["split"], "all"):
                groups.setdefault(f"{kind} {split}", []).append(row["ratio"])
    return {key: spread(ratios) for key, ratios in sorted(groups.items())}


def main(argv) -> None:
    del argv
    sources, cases = load_cases(FLAGS.cases)
    if FLAGS.only:
        cases = [c for c in cases if re.search(FLAGS.only, c.name)]
    stand_in = FLAGS.stand_in or not tokamax_installed()
    results = compiled_cases(cases, stand_in, FLAGS.schedules, FLAGS.recompile)
    parts, failed = [], []
    for case in cases:
        result = results[case.name]
        if "error" in result:
            failed.append((case.name, result["error"]))
        else:
            parts.append(case_parts(case, result))
    costs = V6E
    if FLAGS.fit:
        on = [p for p in parts if p.case.split == "fit" and p.case.program in FLAGS.fit_programs]
        costs, error = fit(on)
        print(f"fitted on {len(on)} cases of {', '.join(FLAGS.fit_programs)}: {costs} (rms "
              f"relative error {error:.3f})")
    rows = [case_row(p, costs) for p in parts]
    compiled = {"JAX stand-ins" if results[p.case.name]["stand_in"] else "tokamax's"
                for p in parts}
    print(f"programs: {' and '.join(sorted(compiled))}; estimates from the "
          f"compiled schedule (a model, no TPU ran them) against measurements from "
          f"{', '.join(sorted(sources))}")
    print(f"{'case':<52} {'split':<8} {'steps':>7} {'kernel':>9} {'XLA':>9} {'estimate':>9} "
          f"{'measured':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['name']:<52} {r['split']:<8} {r['steps']:>7} {r['kernel_s'] * 1e3:>9.3f} "
              f"{r['xla_s'] * 1e3:>9.3f} {r['estimate_s'] * 1e3:>9.3f} "
              f"{r['measured_s'] * 1e3:>9.3f} {r['ratio']:>6.2f}")
    for name, why in failed:
        print(f"{name}: not compiled: {why.splitlines()[0][:200]}")
    stats = summary(rows)
    for key, s in stats.items():
        if s["n"] > 1:
            print(f"estimate / measured, {key}: median {s['median']:.2f}, quartiles "
                  f"{s['q1']:.2f}-{s['q3']:.2f}, range {s['min']:.2f}-{s['max']:.2f} "
                  f"({s['n']} cases)")
    write_json({"costs": dataclasses.asdict(costs), "rows": rows, "failed": failed,
                "summary": stats}, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
