"""The batch job on many hosts: Ray Data runs its shards on a pool of engine actors, one per
device group (the `batch` extra).

A shard is an input file, or a run of its lines; each has its own result file, the same
record as a single-process job's (`server/batch_job.py`), so a job stopped anywhere and run
again redoes only the lines without a result, whichever actor takes the shard. Ray schedules
the shards on the actors and restarts an actor that dies.
"""
import dataclasses
import os

from model.loader import model_name
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from server.batch_job import ResultLog, jsonl_lines, routes, run_job
from server.engine_flags import use_compile_cache


@dataclasses.dataclass(frozen=True)
class Shard:
    input: str
    output: str
    first: int = 0           # its lines [first, end) of the input
    end: int | None = None   # None: to the file's end


def shards(inputs: list[str], output_dir: str, lines_per_shard: int = 0) -> list[Shard]:
    """A shard per input file, or per `lines_per_shard` of its lines, each writing
    `output_dir`/<file>.<first line>.jsonl."""
    out = []
    for path in inputs:
        name = os.path.basename(path)
        if not lines_per_shard:
            out.append(Shard(path, os.path.join(output_dir, f"{name}.0.jsonl")))
            continue
        with open(path, "rb") as f:
            lines = sum(1 for _ in f)
        for first in range(0, max(lines, 1), lines_per_shard):
            out.append(Shard(path, os.path.join(output_dir, f"{name}.{first}.jsonl"), first,
                             first + lines_per_shard))
    return out


class ShardRunner:
    """An engine actor: scores each shard of a batch of them, resuming from its result
    file."""

    def __init__(self, model_path: str | None, engine_cfg: EngineConfig, max_in_flight: int,
                 compile_cache_dir: str = "", served_name: str = ""):
        use_compile_cache(compile_cache_dir)
        self.engine = Engine.from_path(model_path, engine_cfg)
        self.routes = routes(self.engine, served_name or model_name(model_path))
        self.max_in_flight = max_in_flight

    def __call__(self, batch: dict) -> dict:
        counts = {"output": [], "requests": [], "items": [], "failed": []}
        for row in zip(*(batch[k] for k in ("input", "output", "first", "end"))):
            shard = Shard(str(row[0]), str(row[1]), int(row[2]),
                          None if int(row[3]) < 0 else int(row[3]))
            with ResultLog(shard.output) as log:
                done = run_job(jsonl_lines(shard.input, self.routes, shard.first, shard.end),
                               log, self.routes, self.max_in_flight)
            for key, value in (("output", shard.output), ("requests", done.requests),
                               ("items", done.items), ("failed", done.failed)):
                counts[key].append(value)
        return counts


def run_ray_job(all_shards: list[Shard], model_path: str | None, engine_cfg: EngineConfig,
                actors: int, max_in_flight: int, actor_resources: dict | None = None,
                compile_cache_dir: str = "", served_name: str = "") -> list:
    """Every shard, on `actors` engine actors of Ray's cluster (ray.init() first; each actor
    asks a CPU and `actor_resources`, e.g. {"TPU": 4} for a v6e host's chips); the shards'
    counts."""
    import ray.data  # the `batch` extra
    rows = [{**dataclasses.asdict(s), "end": -1 if s.end is None else s.end}
            for s in all_shards]
    return ray.data.from_items(rows).repartition(len(rows)).map_batches(
        ShardRunner, batch_size=1, concurrency=actors,
        fn_constructor_args=(model_path, engine_cfg, max_in_flight, compile_cache_dir,
                             served_name),
        num_cpus=1, resources=actor_resources or None).take_all()
