"""Replicas in this process: a runner and its scheduler on each device group."""
import functools
from typing import Callable

import jax
from absl import logging

from model.config import ModelConfig
from model.loader import DTYPES
from runtime.distributed import agree
from runtime.engine_config import EngineConfig
from runtime.forward_programs import server_programs
from runtime.model_runner import ModelRunner
from runtime.pool_size import DeviceMemory, kv_pool_pages
from runtime.scheduler import Scheduler


def local_replicas(cfg: ModelConfig, params: dict, engine_cfg: EngineConfig, groups: list,
                   runner_type=ModelRunner, publish=None,
                   answered: Callable[[], None] = lambda: None) -> list[Scheduler]:
    """A runner and its scheduler on each device group, warmed up if the config says so;
    `answered`: as Scheduler takes it."""
    device, dtype = groups[0][0], DTYPES[engine_cfg.dtype]
    backend, buckets = engine_cfg.backend(device), engine_cfg.buckets(cfg, device)
    probe = functools.partial(server_programs, engine_cfg, cfg, groups[0])
    pages = kv_pool_pages(engine_cfg, probe, DeviceMemory.of(device))
    if jax.process_count() > 1:
        pages = agree(pages)
    logging.info("replicas: %d of %d %s device(s), %s kernels; KV pool: %d pages of %d "
                 "tokens each", len(groups), len(groups[0]), device.device_kind, backend,
                 pages, engine_cfg.page_size)
    runners = [runner_type(cfg, params, buckets, pages, dtype, backend, group, publish,
                           engine_cfg.program_cache_dir)
               for group in groups]  # across hosts, dp_size is 1: one runner publishes
    if engine_cfg.warmup:
        for runner in runners:
            runner.warm_up()
    return [Scheduler(r, engine_cfg.prefix_cache, engine_cfg.schedule_policy,
                      engine_cfg.pipeline_depth, answered) for r in runners]
