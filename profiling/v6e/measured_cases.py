"""Real v6e measurements to hold the estimate against: a case file, and tokamax's autotuning
cache turned into one.

A case file is JSON: {"sources": {name: {"repository", "commit", "date", "files", "device",
"how"}}, "cases": [case, ...]}, each case {"name", "source", "file", "program", "arguments",
"config", "measured_ms", "split"}: the program (profiling.v6e.measured_programs.PROGRAMS) called
with those arguments (tokamax's argument spec: shapes as "bf16[2,8192,8,256]", the mask, the
scale) and that config, measured_ms its device-time samples on a real chip, split "fit" (the
constants of the model may be fitted on it) or "held_out" (reported only). At most half of
each source file's cases are "fit".

python -m profiling.v6e.measured_cases --tokamax_dir DIR --commit C --date D --out FILE
writes such a file from a tokamax checkout's `tokamax/data/autotuning/tpu_v6_lite/*.json`.
"""
import dataclasses
import hashlib
import json
import os
import re
import statistics

from absl import app, flags

from runtime.cli_flags import parse_flags

CASE_FILE = os.path.join(os.path.dirname(__file__), "data", "tokamax_tpu_v6_lite.json")
TOKAMAX_DIR = "tokamax/data/autotuning/tpu_v6_lite"
# tokamax's cache file -> the program it measured (profiling.v6e.measured_programs.PROGRAMS)
TOKAMAX_FILES = {
    "pallas_mosaic_tpu_flash_attention.json": "tokamax.flash_attention",
    "xla_chunked_dot_product_attention.json": "tokamax.xla_chunked_attention",
    "chunked_xla_linear_softmax_cross_entropy_loss.json": "tokamax.chunked_xla_cross_entropy",
}
TOKAMAX_HOW = (
    "tokamax's autotuner on one v6e chip (device kind 'TPU v6 lite'): for each argument spec "
    "and kernel config, the jitted op (forward) is compiled and run once to warm up, then five "
    "times, each time under an XProf profile; a sample is the device time of all the "
    "program's XLA ops (the union of their intervals), in ms (tokamax/_src/benchmarking.py, "
    "hermetic_xprof timer). Google's autotuning job wrote them.")

_SHAPE = re.compile(r"^(\w+)\[([\d,]*)\]$")


@dataclasses.dataclass(frozen=True)
class MeasuredCase:
    name: str
    source: str
    file: str
    program: str
    arguments: dict
    config: dict
    measured_ms: tuple[float, ...]
    split: str

    @property
    def measured_s(self) -> float:
        return statistics.median(self.measured_ms) / 1e3


def shape_of(spec: str) -> tuple[str, tuple[int, ...]]:
    """("bf16", (2, 8192, 8, 256)) from tokamax's "bf16[2,8192,8,256]"."""
    m = _SHAPE.match(spec)
    if not m:
        raise ValueError(f"not an array spec: {spec!r}")
    return m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)


def load_cases(path: str = CASE_FILE) -> tuple[dict, list[MeasuredCase]]:
    """A case file's sources and cases; a case naming an unknown source or split is refused."""
    with open(path) as f:
        data = json.load(f)
    cases = [MeasuredCase(**{**c, "measured_ms": tuple(c["measured_ms"])})
             for c in data["cases"]]
    for case in cases:
        if case.source not in data["sources"]:
            raise ValueError(f"{path}: case {case.name} names source {case.source!r}, which "
                             f"the file does not describe")
        if case.split not in ("fit", "held_out"):
            raise ValueError(f"{path}: case {case.name} has split {case.split!r}, not 'fit' "
                             f"or 'held_out'")
    return data["sources"], cases


def tokamax_cases(cache_dir: str, source: str) -> list[dict]:
    """Every timed (argument spec, config) of tokamax's v6e cache files, in file order. Half of
    a file's cases (rounded down) are "fit": those whose argument spec and config hash lowest,
    a split that follows no pattern of the file's order (which pairs each shape with and
    without residuals, causal and not)."""
    cases = []
    for fname, program in TOKAMAX_FILES.items():
        with open(os.path.join(cache_dir, fname)) as f:
            cache = json.load(f)
        timed = [(json.loads(spec), json.loads(config), result["evaluation_times_ms"])
                 for spec, configs in cache.items() for config, result in configs.items()
                 if result.get("evaluation_times_ms")]
        stem = fname.removesuffix(".json")
        ranks = sorted(range(len(timed)), key=lambda i: hashlib.sha256(
            json.dumps(timed[i][:2], sort_keys=True).encode()).hexdigest())
        fit = set(ranks[:len(timed) // 2])
        cases += [{"name": f"{stem}/{i:03d}", "source": source, "file": f"{TOKAMAX_DIR}/{fname}",
                   "program": program, "arguments": spec, "config": config,
                   "measured_ms": times, "split": "fit" if i in fit else "held_out"}
                  for i, (spec, config, times) in enumerate(timed)]
    return cases


def _one_case_a_line(data: dict) -> str:
    sources = json.dumps(data["sources"], indent=1).replace("\n", "\n ")
    cases = ",\n  ".join(json.dumps(c, separators=(",", ":")) for c in data["cases"])
    return f'{{\n "sources": {sources},\n "cases": [\n  {cases}\n ]\n}}\n'


FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("tokamax_dir", None, "a checkout of openxla/tokamax", required=True)
    flags.DEFINE_string("commit", None, "the checkout's commit (40 hex digits)", required=True)
    flags.DEFINE_string("date", None, "the commit's date, YYYY-MM-DD", required=True)
    flags.DEFINE_string("out", CASE_FILE, "the case file to write")


def main(argv) -> None:
    del argv
    source = f"tokamax-{FLAGS.commit[:7]}"
    cases = tokamax_cases(os.path.join(FLAGS.tokamax_dir, TOKAMAX_DIR), source)
    data = {"sources": {source: {
        "repository": "https://github.com/openxla/tokamax", "commit": FLAGS.commit,
        "date": FLAGS.date, "files": [f"{TOKAMAX_DIR}/{f}" for f in TOKAMAX_FILES],
        "device": "one TPU v6e chip", "how": TOKAMAX_HOW}}, "cases": cases}
    os.makedirs(os.path.dirname(FLAGS.out), exist_ok=True)
    with open(FLAGS.out, "w") as f:
        f.write(_one_case_a_line(data))
    print(f"{len(cases)} cases ({sum(c['split'] == 'fit' for c in cases)} fit) -> {FLAGS.out}")


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
