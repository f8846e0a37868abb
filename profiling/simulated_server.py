"""python -m profiling.simulated_server --chip_model Qwen3-0.6B --chip_log PATH [--dp-size N]
    [the server's flags]

The server (`python -m server`) with each replica's devices replaced by a simulated v6e chip
(profiling.simulated_chip): forwards held for the model's v6e estimate, no CPU used by them,
the host path untouched. For benchmarks (profiling.bench_serving --chip), never a server flag.
--dp-size N runs N chips, one a replica, on N CPU devices; the chips add what they hold to
the ChipLog at --chip_log, which the benchmark made.
"""
import functools

import jax
from absl import app, flags

from profiling.simulated_chip import ChipLog, ForwardTimes, SimulatedRunner
from runtime.cli_flags import parse_flags
from server import __main__ as server_main
from server import engine_flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("chip_model", "Qwen3-0.6B", "whose v6e forward times the chips hold "
                        "(profiling/v6e/data/forward_times.json)")
    flags.DEFINE_string("chip_log", None, "the benchmark's ChipLog file, a row a chip",
                        required=True)


def main(argv) -> None:
    del argv
    if FLAGS.tp_size != 1:
        raise app.UsageError("a simulated chip is one replica's whole device: --tp-size 1")
    jax.config.update("jax_num_cpu_devices", FLAGS.dp_size)  # a device a replica, to group
    runner = functools.partial(SimulatedRunner, times=ForwardTimes.load(FLAGS.chip_model),
                               log=ChipLog(FLAGS.chip_log, FLAGS.dp_size))
    server_main.run(runner)


if __name__ == "__main__":
    define_flags()
    engine_flags.define_engine_flags()
    server_main.define_server_flags()
    app.run(main, flags_parser=parse_flags)
