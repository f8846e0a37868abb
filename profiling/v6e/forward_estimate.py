"""The scoring forward's v6e estimate from its compiled schedule: the server's program for a
batch's bucket, compiled for one v6e chip, read level by level (profiling.v6e.program_schedule),
with each Pallas kernel priced at the batch's real work (profiling.v6e.kernel_estimates). A model:
no TPU ran it.
"""
import dataclasses

import jax.numpy as jnp
import numpy as np

from kernels.attention_plan import host_plan, visited_kv_blocks
from kernels.kv_write_kernel import PAGES_PER_STEP
from kernels.projection_kernel import (
    call_blocks,
    consecutive_steps,
    quantize_kernel_name,
    sub_block_rows,
)
from kernels.label_gather_kernel import (
    label_rows_cost,
    label_tiles_pay,
    streamed_cost,
    streamed_row_block,
)
from kernels.ragged_paged_attention import written_pages
from kernels.ragged_paged_attention_kernel import whole_block_steps
from kernels.rope_kernel import lane_group, padded_width, rope_kernel_applies
from model.config import ModelConfig
from model.params import param_dtype
from model.decoder import (
    ROTATED_PROJECTIONS,
    block_page_ids,
    norms_in_kernels,
    plan_windows,
    pool_head_dim,
    projection_shapes,
    tiled_head_dim,
)
from profiling.v6e.kernel_estimates import (
    GATHER_KERNELS,
    AttentionBlocks,
    PageRuns,
    attention_estimate,
    kv_write_estimate,
    label_gather_estimate,
    label_run_count,
    mlp_estimate,
    projection_estimate,
    quantize_estimate,
    rope_estimate,
)
from profiling.v6e.hlo_ops import op_facts
from profiling.v6e.program_schedule import level_from_json, program_seconds
from profiling.v6e.roofline import V6E_FLOPS
from profiling.v6e.compile import v6e_devices
from profiling.v6e.chip import V6E
from profiling.v6e.schedule import compile_schedules
from runtime.batch_builder import build_batch
from runtime.buckets import BatchShape
from runtime.engine_config import EngineConfig
from runtime.forward_programs import server_programs

# the pool's size does not change a forward's work, but XLA's memory space assignment around
# it sees it (tests/test_tpu_programs.py compiles the sized models with this pool)
ESTIMATE_POOL_PAGES = 4096


def program_case(model: dict, engine: dict, shape: dict):
    """The server's program for a v6e chip, lowered (for `compile_schedules`)."""
    programs = server_programs(EngineConfig(**engine), ModelConfig(**model), v6e_devices(1),
                               ESTIMATE_POOL_PAGES)
    return programs.lower(BatchShape(**shape))


def v6e_batch(cfg: ModelConfig, engine_cfg: EngineConfig, entries, labels):
    """The batch of `entries` as a v6e server with `engine_cfg` builds it, its shape bucket
    and its block sizes."""
    buckets = engine_cfg.buckets(cfg, v6e_devices(1)[0])
    shape = buckets.shape_of((e.new_tokens for e in entries), len(labels), len(entries))
    return shape, build_batch(entries, labels, shape, buckets.page_size,
                              page_aligned=buckets.page_aligned), buckets.sizes


def forward_estimate(cfg: ModelConfig, engine_cfg: EngineConfig, entries, labels,
                     with_lse: bool, built=None) -> dict:
    """The v6e estimate of one forward of `entries` (ScheduledSeq) scoring `labels` (per row):
    seconds, and per level of the program (outside the layer loop, one layer) the XLA ops'
    bundles and bytes, the kernels' seconds and the costliest XLA ops. `built`: the batch's
    `v6e_batch`, if the caller has it."""
    engine_cfg = dataclasses.replace(engine_cfg, kernel_backend="auto", warmup=False)
    shape, batch, sizes = built or v6e_batch(cfg, engine_cfg, entries, labels)
    case = dict(model=dataclasses.asdict(cfg), engine=dataclasses.asdict(engine_cfg),
                shape=dataclasses.asdict(shape))
    (result,) = compile_schedules("profiling.v6e.forward_estimate:program_case", [case],
                                  program=True)
    kernels = _kernel_estimates(cfg, shape, batch, sizes, engine_cfg.page_size,
                                result["kernels"], labels, with_lse)
    priced = {"ragged_paged_attention": kernels["attention"]["v6e_estimate_s"],
              **({"write_kv_pages": kernels["kv_write"]["v6e_estimate_s"]}
                 if "kv_write" in kernels else {}),
              **({"qk_norm_rope": kernels["rope"]["v6e_estimate_s"]} if "rope" in kernels
                 else {}),
              **{name: kernels[name]["v6e_estimate_s"]
                 for name in (*projection_shapes(cfg), *map(quantize_kernel_name,
                                                            projection_shapes(cfg)),
                              "mlp", "out_and_mlp") if name in kernels},
              **{name: 0.0 for name in GATHER_KERNELS.values()},  # the branch not taken
              GATHER_KERNELS[kernels["gather"]["mode"]]: kernels["gather"]["v6e_estimate_s"]}
    levels, facts = _levels(result, cfg.num_layers), op_facts(result["hlo"])
    hlo_bytes = {name: f.hbm_bytes for name, f in facts.items()}
    return {"v6e_estimate_s": program_seconds(levels, priced, hlo_bytes=hlo_bytes),
            "levels": [_level_summary(level, priced, facts, hlo_bytes) for level in levels],
            "shape": dataclasses.asdict(shape), "block_sizes": dataclasses.asdict(sizes),
            "page_size": engine_cfg.page_size, "kernels": kernels}


def _levels(result: dict, num_layers: int) -> list:
    """The program's levels, one of them the layer loop's (else the listing was misread)."""
    levels = [level_from_json(x) for x in result["levels"]]
    if not any(level.trips == num_layers for level in levels):
        raise ValueError(f"no level of the program's listing runs {num_layers} times (the "
                         f"layer loop), trips {[level.trips for level in levels]}: the listing "
                         "was not read as it was written")
    return levels


def _level_summary(level, priced: dict, facts: dict, hlo_bytes: dict,
                   least_bundles: int = 500) -> dict:
    """A level's seconds, and each XLA op of at least `least_bundles` bundles a trip (most
    first): what it does, its bundles and DMA bytes, and its own MXU bound (its FLOPs at the
    bf16 peak)."""
    xla = level.xla_cost(priced, hlo_bytes)
    ops = sorted(((name, cost) for name, cost in level.xla_calls(priced).items()
                  if cost.bundles >= least_bundles), key=lambda kv: -kv[1].bundles)
    return {"trips": level.trips, "seconds_per_trip": level.seconds(priced,
                                                                    hlo_bytes=hlo_bytes),
            "xla_bundles": xla.bundles, "xla_hbm_bytes": xla.hbm_bytes,
            "kernels_s": level.kernels_seconds(priced),
            "unknown_loops": level.unknown_loops,
            "xla_ops": [_op_row(name, cost, facts.get(name)) for name, cost in ops]}


def _op_row(name: str, cost, facts) -> dict:
    flops = facts.flops if facts else 0.0
    return {"name": name, "scope": facts.scope if facts else "", "fuses": facts.ops if facts
            else "", "bundles": cost.bundles, "seconds": cost.bundles / V6E.clock_hz,
            "dma_bytes": cost.hbm_bytes, "hbm_bound_s": cost.hbm_bytes / V6E.hbm_bytes_per_s,
            "flops": flops, "mxu_bound_s": flops / V6E_FLOPS}


def _kernel_estimates(cfg: ModelConfig, shape: BatchShape, batch, sizes, page_size: int,
                      schedules: dict, labels, with_lse: bool) -> dict:
    """Each kernel of the forward at the batch's real work."""
    d = pool_head_dim(cfg, "pallas")
    page_ids = np.asarray(written_pages(batch.attention, page_size, ESTIMATE_POOL_PAGES)[0])
    real_pages = int(np.sum(page_ids < ESTIMATE_POOL_PAGES))
    rows, n_labels, runs = shape.rows, max(len(row) for row in labels), label_run_count(labels)
    mode = ("labels_only" if not with_lse and label_tiles_pay(runs, n_labels, cfg.vocab_size)
            else "streamed_logsumexp")
    gather_cost = (label_rows_cost(rows, n_labels, cfg.hidden_size, 2, runs)
                   if mode == "labels_only"
                   else streamed_cost(rows, n_labels, cfg.vocab_size, cfg.hidden_size,
                                      streamed_row_block(rows), 2))
    rope = ({"rope": _rope_estimate(cfg, shape, schedules["qk_norm_rope"])}
            if "qk_norm_rope" in schedules else {})  # heads it takes (kernels.rope_kernel)
    group = (lane_group(cfg.head_dim) if rope_kernel_applies(cfg.head_dim, cfg.qk_norm)
             and "qk_norm_rope" not in schedules else 0)  # q's and k's RoPE in projections
    into_pages = "write_kv_pages" not in schedules  # k and v go to pages in their projection
    blocks = _projection_blocks(cfg, shape.tokens, page_size, into_pages)
    paged = ({"project_kv": _page_runs(batch, blocks["project_kv"], page_size)}
             if into_pages else {})
    tiles = tiled_head_dim(cfg, d)  # q's, k's and v's heads a lane tile each, into pages
    spread = d // tiles if tiles and into_pages else 1
    attn_spread = d // tiles if tiles and not cfg.sandwich_norms else 1  # _attention_output
    projections = {name: projection_estimate(
        schedules[name], shape.tokens, *dims, 2, group if name in ROTATED_PROJECTIONS else 0,
        blocks[name], paged.get(name), _weight_itemsize(cfg),
        spread if name in ROTATED_PROJECTIONS else 1,
        attn_spread if name == "project_out" else 1)
        for name, dims in projection_shapes(cfg).items()
        if name in schedules}  # weights it takes (kernels.projection_kernel)
    quantized = {quantize_kernel_name(name): quantize_estimate(
        schedules[quantize_kernel_name(name)], shape.tokens, dims[0], 2)
        for name, dims in projection_shapes(cfg).items()
        if quantize_kernel_name(name) in schedules}  # int8 x before it
    out_depth = projection_shapes(cfg)["project_out"][0]
    mlp = {name: mlp_estimate(schedules[name], shape.tokens, cfg.hidden_size,
                              cfg.intermediate_size, 2, residual=True,
                              out_depth=out_depth if name == "out_and_mlp" else 0,
                              weight_itemsize=_weight_itemsize(cfg),
                              x_spread=attn_spread if name == "out_and_mlp" else 1)
           for name in ("mlp", "out_and_mlp") if name in schedules}  # one chip
    kv_write = {} if into_pages else {"kv_write": kv_write_estimate(
        schedules["write_kv_pages"], -(-len(page_ids) // PAGES_PER_STEP), PAGES_PER_STEP,
        real_pages, cfg.num_kv_heads * page_size * d * 2)}
    return {
        **rope, **projections, **quantized, **mlp, **kv_write,
        "attention": _attention_estimate(cfg, batch, sizes, page_size,
                                         schedules["ragged_paged_attention"]),
        "gather": {"mode": mode, **label_gather_estimate(
            schedules[GATHER_KERNELS[mode]], mode, rows, cfg.vocab_size, cfg.hidden_size,
            n_labels, gather_cost.bytes_accessed)}}


def _attention_estimate(cfg: ModelConfig, batch, sizes, page_size: int, schedule) -> dict:
    """The attention kernel a layer, on average: the full layers run the batch's plan, the
    windowed ones (`cfg.layer_windows`) the window's, which leaves out what it hides."""
    blocks = AttentionBlocks(sizes.q_block * cfg.num_heads // cfg.num_kv_heads,
                             cfg.num_kv_heads, pool_head_dim(cfg, "pallas"), sizes, 2)

    def at(window: int) -> dict:
        plan = host_plan(batch.attention, sizes, page_size, window)
        return {"plan_steps": visited_kv_blocks(plan), **attention_estimate(
            schedule, plan, visited_kv_blocks(plan), blocks.cost(plan).bytes_accessed, blocks,
            whole_block_steps(plan, batch.attention, sizes, page_size, ESTIMATE_POOL_PAGES))}

    per_layer = plan_windows(cfg)
    by_window = {w: at(w) for w in sorted(set(per_layer))}
    if len(by_window) == 1:
        return by_window[per_layer[0]]
    mean = sum(by_window[w]["v6e_estimate_s"] for w in per_layer) / len(per_layer)
    return {**by_window[0], "v6e_estimate_s": mean,
            "full_layer_s": by_window[0]["v6e_estimate_s"],
            "windowed_layer": by_window[max(by_window)]}


def _page_runs(batch, blocks, page_size: int) -> PageRuns:
    """How the k and v projection copies the batch's pages: its steps whose pages follow each
    other, the pages as the model gives them (a padding block's the pool's last)."""
    ids = block_page_ids(batch.block_pages, ESTIMATE_POOL_PAGES)
    share = float(np.mean(np.asarray(consecutive_steps(ids, blocks.rows // page_size))))
    return PageRuns(2 * sub_block_rows(blocks.rows) // page_size, share)


def _weight_itemsize(cfg: ModelConfig) -> int:
    """Bytes of a projection weight's element in the bfloat16 server (an int8 model's: 1)."""
    return param_dtype(cfg, "wq", jnp.bfloat16).itemsize


def _projection_blocks(cfg: ModelConfig, tokens: int, page_size: int,
                       into_pages: bool) -> dict:
    """Each call's blocks, as the model's calls take them (model.decoder): k's and v's into
    pages, the input norms in the calls that read them where they fit."""
    shapes, weight_itemsize = projection_shapes(cfg), _weight_itemsize(cfg)
    norms = norms_in_kernels(cfg, tokens, shapes["project_q"][1], shapes["project_kv"][1],
                             shapes["gate_up"][1], weight_itemsize)
    normed = (("project_q", "project_kv") if norms.attention else ()) + (
        ("gate_up",) if norms.mlp else ())
    return {name: call_blocks(tokens, *shapes[name][:3], 2,
                              page_size if into_pages and name == "project_kv" else None,
                              name in normed, weight_itemsize) for name in shapes}


def _rope_estimate(cfg: ModelConfig, shape: BatchShape, schedule) -> dict:
    """The norm and RoPE kernel on q and k padded to whole lane groups, as its wrapper pads."""
    q_width, k_width = (padded_width(heads * cfg.head_dim, cfg.head_dim)
                        for heads in (cfg.num_heads, cfg.num_kv_heads))
    return rope_estimate(schedule, shape.tokens, q_width, k_width, 2, lane_group(cfg.head_dim))
