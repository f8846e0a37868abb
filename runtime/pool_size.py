"""How many KV pages a replica's pool gets.

`--kv-cache-tokens` when given; on CPU, where the runtime reports no memory limit, a few
batches' worth; on an accelerator, what fits `--mem-fraction` of a device's memory beside
everything else the largest forward holds there. That is read from the compiled program
(`memory_analysis()`: the params as placed, the batch, the temp and the outputs), not guessed.
"""
import dataclasses
from typing import Callable

from runtime.buckets import pages_needed
from runtime.engine_config import EngineConfig
from runtime.forward_programs import ForwardPrograms, footprint

CPU_BATCHES = 4  # the CPU pool: this many full batches of tokens


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    limit: int       # bytes the runtime lets programs use on one device
    in_use: int = 0  # bytes taken before this replica is placed

    @classmethod
    def of(cls, device) -> "DeviceMemory | None":
        """None where the runtime reports no limit (CPU)."""
        stats = device.memory_stats() if device.platform != "cpu" else None
        if not stats or "bytes_limit" not in stats:
            return None
        return cls(stats["bytes_limit"], stats.get("bytes_in_use", 0))


def bytes_beside_pool(programs: ForwardPrograms) -> int:
    """Per device, what the largest bucket's program holds besides the KV pool: arguments
    (params, batch), temp, and outputs that are not the donated pool."""
    return footprint(programs.get(programs.buckets.all_shapes()[-1])) - programs.pool_bytes


def cpu_pool_tokens(engine_cfg: EngineConfig) -> int:
    """The pool where the runtime reports no memory limit: CPU_BATCHES full batches, and at
    least one batch's pages."""
    return max(CPU_BATCHES * engine_cfg.max_prefill_tokens, engine_cfg.min_kv_tokens)


def kv_pool_pages(engine_cfg: EngineConfig, programs_with: Callable[[int], ForwardPrograms],
                  memory: DeviceMemory | None) -> int:
    """`programs_with(num_pages)`: a replica's programs over a pool of that many pages, from
    the model's shapes (runtime.forward_programs.server_programs). Raises ValueError when not
    even one batch fits."""
    min_pages = pages_needed(engine_cfg.min_kv_tokens, engine_cfg.page_size)
    if engine_cfg.kv_cache_tokens or memory is None:
        tokens = engine_cfg.kv_cache_tokens or cpu_pool_tokens(engine_cfg)
        return max(pages_needed(tokens, engine_cfg.page_size), min_pages)
    probe = programs_with(min_pages)
    room = memory.limit * engine_cfg.mem_fraction - memory.in_use - bytes_beside_pool(probe)
    pages = int(room // (probe.pool_bytes // probe.num_pages))
    if pages < min_pages:
        raise ValueError(
            f"--mem-fraction {engine_cfg.mem_fraction} of {memory.limit / 2**30:.1f} GiB "
            f"({memory.in_use / 2**30:.1f} GiB in use) leaves room for {max(pages, 0)} KV "
            f"pages beside the params and the largest forward; one batch needs {min_pages}: "
            f"lower --max-prefill-tokens or raise --mem-fraction")
    return pages
