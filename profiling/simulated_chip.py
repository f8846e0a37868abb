"""A simulated v6e chip for serving benchmarks: a stand-in for a replica's ModelRunner that
holds each forward for the calibrated v6e estimate of its bucket for a named model, using no
CPU meanwhile, so that the host path (HTTP, parsing, tokenizing, scheduling, answering) is
measured at a chip's pace on a machine without one. Never a server flag: the benchmarks start
the server through profiling.simulated_server.

The estimates come from profiling/v6e/data/forward_times.json (`python -m
profiling.simulated_chip --models Qwen3-0.6B` rewrites it: the v6e estimate of a forward of
SGLang's base shape filling each bucket, profiling.v6e.forward_breakdown), linear between
the buckets measured. A forward's scores are zeros: the answers' numbers are not the point.
Each chip adds the seconds it holds forwards, and their count, to a shared log (`ChipLog`)
that the benchmark reads from outside the server.
"""
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import time
from typing import NamedTuple

import numpy as np
from absl import app, flags

TIMES_PATH = os.path.join(os.path.dirname(__file__), "v6e", "data", "forward_times.json")


@dataclasses.dataclass(frozen=True)
class ForwardTimes:
    """A model's v6e estimate of one forward by its tokens: linear between measured buckets,
    the smallest's below them and growing as the last two's slope above them."""
    model: str
    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self):
        if (len(self.tokens) < 2 or len(self.tokens) != len(self.seconds)
                or list(self.tokens) != sorted(set(self.tokens))
                or min(self.seconds) <= 0):
            raise ValueError(f"{self.model}: forward times need two or more increasing token "
                             f"counts with positive seconds, got {self.tokens} {self.seconds}")

    def of(self, tokens: int) -> float:
        if tokens <= self.tokens[-1]:
            return float(np.interp(tokens, self.tokens, self.seconds))
        slope = ((self.seconds[-1] - self.seconds[-2]) / (self.tokens[-1] - self.tokens[-2]))
        return self.seconds[-1] + slope * (tokens - self.tokens[-1])

    @classmethod
    def load(cls, model: str, path: str = TIMES_PATH) -> "ForwardTimes":
        with open(path) as f:
            table = json.load(f)["models"]
        if model not in table:
            raise ValueError(f"no v6e forward times for {model} in {path}: it has "
                             f"{sorted(table)} (python -m profiling.simulated_chip --models "
                             f"{model} adds them)")
        return cls(model, tuple(table[model]["tokens"]), tuple(table[model]["seconds"]))


class ChipLog:
    """Per chip, the seconds it held forwards and their count, in a file mapped into memory:
    the server's chips add to it, the benchmark reads it (float64 [chips, 2])."""

    def __init__(self, path: str, chips: int, create: bool = False):
        self.path, self.chips = path, chips
        self.values = np.memmap(path, np.float64, "w+" if create else "r+", shape=(chips, 2))

    def __reduce__(self):  # to an engine process: the same file, mapped there
        return ChipLog, (self.path, self.chips)

    def add(self, chip: int, seconds: float) -> None:
        self.values[chip] += (seconds, 1.0)

    def read(self) -> np.ndarray:
        return np.array(self.values)


class SimulatedDevice(NamedTuple):
    id: int
    platform: str = "simulated"
    device_kind: str = "TPU v6e"


class _Held(NamedTuple):
    done_at: float  # time.perf_counter() when the chip finishes it
    rows: int
    labels: int


class SimulatedRunner:
    """ModelRunner's interface for the engine and its scheduler: forwards run one after
    another on the chip, each held for `times.of(its bucket's tokens)`; `collect` sleeps
    until its forward is done. Made as the engine makes a ModelRunner (the params and the
    rest are not used), with `times` and `log` bound first; the chip is its group's first
    device's id."""

    backend = "simulated"
    compile_count = 0

    def __init__(self, cfg, params, buckets, num_pages: int, dtype, backend, devices,
                 publish=None, program_cache_dir: str = "", *, times: ForwardTimes,
                 log: ChipLog):
        del cfg, params, dtype, backend, publish, program_cache_dir
        self.buckets, self.num_pages, self.times, self.log = buckets, num_pages, times, log
        self.chip = devices[0].id
        self.devices = [SimulatedDevice(self.chip, device_kind=f"TPU v6e for {times.model}")]
        self._free_at = 0.0  # when the forwards dispatched so far are done

    def warm_up(self, threads: int = 1) -> None:
        del threads

    def dispatch(self, batch, shape) -> _Held:
        del batch
        start = max(time.perf_counter(), self._free_at)
        held = self.times.of(shape.tokens)
        self._free_at = start + held
        self.log.add(self.chip, held)  # counted when it starts: a window's last is early
        return _Held(self._free_at, shape.rows, shape.labels)

    def collect(self, pending: _Held) -> tuple[np.ndarray, np.ndarray]:
        time.sleep(max(0.0, pending.done_at - time.perf_counter()))
        return np.zeros((pending.rows, pending.labels)), np.zeros(pending.rows)

    def reset_cache(self) -> None:
        pass


FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_list("models", ["Qwen3-0.6B"], "models whose forward times to (re)write")
    flags.DEFINE_list("buckets", ["128", "256", "512", "1024", "2048", "4096", "8192"],
                      "forward sizes in tokens")


def main(argv) -> None:
    del argv
    # here, not at the top: the server's chips need none of the v6e cost model
    from profiling.v6e.forward_breakdown import breakdown
    try:
        with open(TIMES_PATH) as f:
            table = json.load(f)
    except FileNotFoundError:
        table = {"models": {}}
    commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                            capture_output=True, text=True, check=False).stdout.strip()
    for model in FLAGS.models:
        tokens = sorted(int(b) for b in FLAGS.buckets)
        seconds = [breakdown(model, t)["seconds"] for t in tokens]
        table["models"][model] = {
            "tokens": tokens, "seconds": seconds,
            "source": "the v6e estimate of a forward of SGLang's base shape filling the "
                      "bucket (profiling.v6e.forward_breakdown)",
            "command": f"python -m profiling.simulated_chip --models {model} --buckets "
                       f"{','.join(map(str, tokens))}",
            "commit": commit, "date": datetime.date.today().isoformat(),
            "machine": platform.processor() or platform.machine()}
        print(model, {t: f"{s * 1e3:.3f} ms" for t, s in zip(tokens, seconds)})
    with open(TIMES_PATH, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    from runtime.cli_flags import parse_flags
    define_flags()
    app.run(main, flags_parser=parse_flags)
