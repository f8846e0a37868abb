"""Child process of `profiling.v6e.schedule.compile_schedules`: started with libtpu told to dump
its schedules, it compiles each case for one v6e chip and writes what the dumps say.

Reads a JSON request on stdin: {"builder": "module:function", "cases": [kwargs, ...],
"dump_dir": D, "out": F, "program": whether to read the whole program's levels and its
optimized HLO too, "keep_going": whether a case that fails to build or compile gives
{"error": why} and the next case goes on (else the worker stops)};
`builder(**kwargs)` returns (fn, args) for `compile_for_v6e`, or a program lowered for a v6e
chip (jax.stages.Lowered).
"""
import importlib
import json
import shutil
import sys

import jax

from profiling.v6e.program_schedule import level_to_json, program_levels, read_listings
from profiling.v6e.compile import compile_for_v6e, mosaic_kernels, xla_costs
from profiling.v6e.schedule import read_dumps, schedule_to_json


def _compiled(built) -> jax.stages.Compiled:
    if isinstance(built, jax.stages.Lowered):
        return built.compile()
    fn, args = built
    return compile_for_v6e(fn, *args)


def _result(built, dump_dir: str, program: bool) -> dict:
    compiled = _compiled(built)
    kernels = read_dumps(dump_dir)
    return {"kernels": {k: schedule_to_json(kernels[k]) for k in mosaic_kernels(compiled)},
            "xla": xla_costs(compiled),
            "levels": [level_to_json(level) for level in program_levels(
                read_listings(dump_dir))] if program else None,
            "hlo": compiled.as_text() if program else None}


def main() -> None:
    request = json.load(sys.stdin)
    module, function = request["builder"].split(":")
    builder = getattr(importlib.import_module(module), function)
    results = []
    for case in request["cases"]:
        shutil.rmtree(request["dump_dir"], ignore_errors=True)
        try:
            results.append(_result(builder(**case), request["dump_dir"], request["program"]))
        except Exception as e:  # noqa: BLE001 (a case that fails is reported, not fatal)
            if not request["keep_going"]:
                raise
            results.append({"error": f"{type(e).__name__}: {e}"[:2000]})
    with open(request["out"], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
