"""Our Pallas kernels' v6e estimates at a batch's real work, from their compiled schedules
(`profiling.v6e.schedule`: a model, no TPU ran them). Shared by the kernel studies and the
forward's estimate, which compile the kernels in different programs.
"""
import dataclasses

from kernels.attention_plan import (
    AttentionPlan,
    BlockSizes,
    live_tile_share,
    real_q_blocks,
    visited_kv_blocks,
    visited_tiles,
)
from kernels.label_gather_kernel import (
    head_tile_rows,
    label_groups,
    label_row_block,
    streamed_row_block,
)
from kernels.mlp_kernel import mlp_bytes, mlp_rows
from kernels.projection_kernel import (
    ProjectionBlocks,
    first_chunk_columns,
    first_step_waits,
    projection_blocks,
    projection_bytes,
    x_comes_quantized,
)
from kernels.quantize_kernel import quantize_row_block
from kernels.ragged_paged_attention_kernel import attention_cost
from kernels.rope_kernel import rope_block_tokens
from kernels.tpu_tiles import SUBLANES
from profiling.v6e.chip import V6E
from profiling.v6e.schedule import KernelSchedule, estimate_seconds

GATHER_KERNELS = {"labels_only": "label_gather_rows", "streamed_logsumexp": "label_gather_streamed"}


def attention_estimate(schedule: KernelSchedule, plan: AttentionPlan, steps: int,
                       kernel_bytes: float, blocks: "AttentionBlocks",
                       whole_steps: int | None = None) -> dict:
    """The attention kernel over `steps` real steps of `plan`, `whole_steps` of them copying
    their KV block whole (default: all), moving `kernel_bytes` (its own count: the listing
    holds each step's copies both ways, and may hold the first step's prefetch, predicated),
    after its fill (the first q block and KV block) and before its drain (the last q block's
    output); its branches priced as `_attention_span_runs` reads them."""
    whole_steps = steps if whole_steps is None else whole_steps
    tiles = visited_tiles(plan, blocks.sizes)
    runs = _attention_span_runs(schedule, steps, real_q_blocks(plan), tiles, whole_steps)
    parents = {kid: p for p in runs for kid in schedule.children(p)}
    skipped = {i: (runs.get(parents.get(i), steps) - n) / steps for i, n in runs.items()}
    step_bytes = kernel_bytes / steps
    return {"step_bundles": schedule.step_bundles(skipped), "tile_runs": tiles,
            "whole_block_steps": whole_steps,
            "step_units": schedule.step_units, "step_hbm_bytes": step_bytes,
            "listed_step_dma_bytes": schedule.step_hbm_dma_bytes,
            "fill_s": blocks.fill / V6E.hbm_bytes_per_s,
            "drain_s": blocks.drain / V6E.hbm_bytes_per_s,
            "v6e_estimate_s": estimate_seconds(schedule, steps, skipped=skipped,
                                               step_bytes=step_bytes, fill_bytes=blocks.fill,
                                               drain_bytes=blocks.drain)}


def _attention_span_runs(schedule: KernelSchedule, steps: int, q_blocks: int, tiles: list,
                         whole_steps: int) -> dict[int, float]:
    """The steps that run each branch of the attention kernel's step. At depth 1: the step's
    work (the largest span) and the prefetches the compiler branches around rather than
    predicating them: the first step's, which runs once, and the next step's, in all steps
    but the last (a lone one is priced as the next's, the dearer reading). Inside a prefetch,
    a branch of many DMAs is the copy a page, which runs where a block is not whole, a branch
    of two the whole block's. The work's innermost spans end with the first step's init, each
    tile's body and the last step's store: the init and store run once per real q block, a
    tile in the steps whose plan bit says so; spans before them are the waits, priced as the
    copies."""
    outer = [i for i, span in enumerate(schedule.spans) if span.depth == 1]
    work = max(outer, key=lambda i: schedule.spans[i].bundles)
    prefetches, inner = [i for i in outer if i != work], schedule.children(work)
    if len(prefetches) > 2 or len(inner) < len(tiles) + 2:
        raise ValueError(f"{schedule.name}: {len(prefetches)} prefetch spans and {len(inner)} "
                         f"inside the step's work, expected at most 2, and the init, "
                         f"{len(tiles)} tiles and the store")
    runs = dict(zip(prefetches, (1, steps - 1) if len(prefetches) == 2 else (steps - 1,)))
    runs[work] = steps
    waits, tail = inner[:-len(tiles) - 2], inner[-len(tiles) - 2:]
    runs |= dict(zip(tail, [q_blocks, *tiles, q_blocks]))
    for parent, kids in [(p, schedule.children(p)) for p in prefetches] + [(work, waits)]:
        for kid in kids:
            taken = steps - whole_steps if schedule.spans[kid].dmas > 2 else whole_steps
            runs[kid] = runs[parent] * taken / steps
    return runs


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """Bytes of the attention kernel's first step's blocks (a q block of `rows` rows per KV
    head, a KV block of K and V) and of its last output block, at block `sizes`."""
    rows: int
    kv_heads: int
    head_dim: int
    sizes: BlockSizes
    itemsize: int

    @property
    def kv_block(self) -> int:
        return self.sizes.kv_block

    @property
    def fill(self) -> int:
        return self.kv_heads * self.head_dim * self.itemsize * (self.rows + 2 * self.kv_block)

    @property
    def drain(self) -> int:
        return self.kv_heads * self.head_dim * self.itemsize * self.rows

    def cost(self, plan: AttentionPlan):
        """The kernel's cost at `plan`'s real steps, q blocks and tiles."""
        return attention_cost(visited_kv_blocks(plan), real_q_blocks(plan), self.rows,
                              self.kv_heads, self.head_dim, self.kv_block, self.itemsize,
                              live_tile_share(plan, self.sizes))


def label_gather_steps(mode: str, rows: int, vocab: int, hidden: int) -> int:
    """Grid steps of the gather kernel: row blocks (labels only), or row blocks x vocabulary
    tiles (streamed)."""
    if mode == "labels_only":
        return -(-rows // label_row_block(rows))
    return -(-rows // streamed_row_block(rows)) * -(-vocab // head_tile_rows(vocab, hidden, 2))


def label_gather_estimate(schedule: KernelSchedule, mode: str, rows: int, vocab: int,
                          hidden: int, labels: int, kernel_bytes: float,
                          itemsize: int = 2) -> dict:
    """The gather kernel of `mode` on `rows` rows of `labels` labels (streamed: one call per
    group of `label_groups`, each streaming the head), each loop with a runtime bound run once
    per label of its call: the streamed kernel's loop over labels; labels only, with one
    label run, an upper bound (its loops over a chunk's tiles and labels run once per label,
    its loop over chunks once, its scan for the next run never). A head tile clamped at the
    vocabulary's end has a runtime size: then the step's bytes are `kernel_bytes` (the
    calls' own count) per step. Each call's fill: its first block of hidden rows and of
    head rows (its outputs, a few floats a row, drain in no time)."""
    calls = label_groups(labels) if mode == "streamed_logsumexp" else [labels]
    steps = label_gather_steps(mode, rows, vocab, hidden)
    step_bytes = kernel_bytes / steps / len(calls) if schedule.step_unsized_dmas else None
    fill = itemsize * hidden * (
        streamed_row_block(rows) + head_tile_rows(vocab, hidden, itemsize)
        if mode == "streamed_logsumexp" else label_row_block(rows) + SUBLANES)

    def per_label(n: int) -> dict:
        return {j: n for j, (_, trips, _) in enumerate(schedule.inner_loops) if trips is None}
    return {"step_bundles": schedule.step_bundles(loop_trips=per_label(calls[0])),
            "fill_s": len(calls) * fill / V6E.hbm_bytes_per_s,
            "v6e_estimate_s": sum(estimate_seconds(schedule, steps, loop_trips=per_label(n),
                                                   step_bytes=step_bytes, fill_bytes=fill)
                                  for n in calls)}


def label_run_count(row_labels: list[list[int]]) -> int:
    """Label runs of a batch's rows: consecutive rows with the same label ids."""
    return 1 + sum(a != b for a, b in zip(row_labels, row_labels[1:]))


def rope_estimate(schedule: KernelSchedule, tokens: int, q_width: int, k_width: int,
                  itemsize: int, group: int) -> dict:
    """q's and k's norm and RoPE over `tokens`: its grid steps, each reading and writing a
    block of q and k and reading the block's two float32 tables (the listing's steps are
    software-pipelined: a program's reading of its loop would count the pipeline's fill),
    after the first block's reads (fill) and before the last block's writes (drain)."""
    block = rope_block_tokens(tokens, q_width * itemsize)
    step_bytes = block * (2 * (q_width + k_width) * itemsize + 2 * group * 4)
    drain = block * (q_width + k_width) * itemsize
    return {"steps": tokens // block, "step_bundles": schedule.step_bundles(),
            "fill_s": (step_bytes - drain) / V6E.hbm_bytes_per_s,
            "drain_s": drain / V6E.hbm_bytes_per_s,
            "v6e_estimate_s": estimate_seconds(schedule, tokens // block,
                                               step_bytes=step_bytes,
                                               fill_bytes=step_bytes - drain,
                                               drain_bytes=drain)}


def quantize_estimate(schedule: KernelSchedule, tokens: int, depth: int, itemsize: int
                      ) -> dict:
    """x quantized (and normed) before an int8 projection (kernels.quantize_kernel): its grid
    steps, each reading a block of x and writing its int8 values and scales, after the first
    block's read (fill) and before the last block's writes (drain)."""
    rows = quantize_row_block(tokens, depth, itemsize)
    read, written = rows * depth * itemsize, rows * (depth + 4)
    return {"steps": tokens // rows, "step_bundles": schedule.step_bundles(),
            "v6e_estimate_s": estimate_seconds(schedule, tokens // rows,
                                               step_bytes=read + written, fill_bytes=read,
                                               drain_bytes=written)}


@dataclasses.dataclass(frozen=True)
class PageRuns:
    """k's and v's projection into pages: each sub-block's page-by-page branch starts `dmas`
    copies, and it runs in the steps whose pages do not follow each other, all but `share`
    of them (the others copy their pages in one DMA each for k and v, predicated, not
    branched around, in the compiled schedule)."""
    dmas: int
    share: float


def projection_estimate(schedule: KernelSchedule, tokens: int, depth: int, width: int,
                        weights: int, outputs: int, itemsize: int, rope_group: int = 0,
                        blocks: ProjectionBlocks | None = None,
                        pages: PageRuns | None = None, weight_itemsize: int | None = None,
                        spread: int = 1, x_spread: int = 1) -> dict:
    """A projection kernel (kernels.projection_kernel) over `tokens`, with RoPE's tables of
    `rope_group` lanes where it rotates, in `blocks` (default: the projection's own): its
    fill (the first block of x and the first chunk of the first weight block, copied in
    before the first step with nothing to overlap them), its first step (the rest of that
    weight block arriving while it computes, each group of chunks' products after their
    group, `first_step_waits`: the larger of its bundles and those bytes plus the last
    group's share of its bundles), then its other steps, each at the larger of its bundles
    and its share of the rest of the bytes the kernel moves (the listing holds every block's
    DMA in every step, where the pipeline skips a block that did not change), then its drain
    (the last step's output blocks, written after it). Into pages, its outputs' bytes are
    the pages' (and its drain an upper bound: the pages of a step's sub-blocks but its last
    are copied while it computes), and a branch that copies them a page at a time is taken
    in the steps `pages` says. int8 weights: `weight_itemsize` 1 (x's `itemsize` else); x
    then comes int8 where a step holds a block of the columns (`quantize_estimate` prices
    the kernel quantizing it). `spread`, `x_spread`: how much wider its outputs are written
    than its products, and x comes than it multiplies (heads a lane tile each:
    projection_kernel.project's `tile_heads`, `x_tile_heads`)."""
    blocks = blocks or projection_blocks(tokens, depth, width, weights, itemsize,
                                         weight_itemsize)
    x_itemsize = 1 if x_comes_quantized(blocks, width, weight_itemsize == 1) else itemsize
    x_spread = 1 if x_itemsize == 1 else x_spread  # XLA packs it for the quantize kernel
    steps = blocks.steps(tokens, width)
    block_weights = weights * depth * blocks.columns * (weight_itemsize or itemsize)
    chunk = first_chunk_columns(width, blocks)
    fill = blocks.rows * depth * x_spread * x_itemsize + block_weights * chunk // blocks.columns
    later = block_weights - block_weights * chunk // blocks.columns  # during the first step
    drain = outputs * blocks.rows * blocks.columns * spread * itemsize
    step_bytes = (projection_bytes(tokens, depth, width, weights, outputs, x_itemsize, itemsize,
                                   blocks, rope_group, weight_itemsize, spread, x_spread)
                  - fill - later - drain) / steps
    first, others = _first_step_bundles(schedule, chunk < blocks.columns and steps > 1,
                                        pages)
    if steps == 1:  # no grid loop: the listing's prologue is the step
        first = others = schedule.prologue + schedule.step
    last_wait = first_step_waits(blocks.columns // chunk)[-1]  # its products after the last
    last_chunk = first * len(last_wait) * chunk / blocks.columns if later else 0
    return {"steps": steps, "rows": blocks.rows, "columns": blocks.columns,
            "step_bundles": others, "first_step_bundles": first,
            **_weights_in_first_step(schedule, steps, first, others, fill, later, step_bytes,
                                     last_chunk, drain)}


def mlp_estimate(schedule: KernelSchedule, tokens: int, hidden: int, inner: int,
                 itemsize: int, residual: bool, out_depth: int = 0,
                 weight_itemsize: int | None = None, x_spread: int = 1) -> dict:
    """The MLP kernel (kernels.mlp_kernel; after the output projection of `out_depth` inputs
    where it takes one) over `tokens`: its fill (the first blocks of its input and of the
    residual, and the first chunk of the weights it waits for first), its first step (the
    rest of the weights arriving while it computes, each group of chunks' products after their
    group: the larger of its bundles and those bytes plus the share of its bundles, by FLOPs,
    of the last group's down products, which wait for down's last rows), its other steps
    (each the larger of its bundles and its share of the bytes), its drain (the last output
    block) and its grid steps."""
    rows = mlp_rows(tokens)
    steps = tokens // rows
    chunk, out_chunk = (first_chunk_columns(w, ProjectionBlocks(rows, w))
                        for w in (inner, hidden))
    weight_itemsize = weight_itemsize or itemsize
    first_weights = out_depth * out_chunk if out_depth else 2 * hidden * chunk
    block = rows * hidden * itemsize
    fill = (rows * (out_depth or hidden) * x_spread * itemsize + block * residual
            + first_weights * weight_itemsize)
    later = ((3 * inner + out_depth) * hidden - first_weights) * weight_itemsize
    step_bytes = (mlp_bytes(tokens, hidden, inner, itemsize, itemsize, residual, out_depth,
                            weight_itemsize, x_spread) - fill - later - block) / steps
    first, others = _first_step_bundles(schedule, chunked=True)
    last_share = len(first_step_waits(inner // chunk)[-1]) * chunk / inner * (
        inner / (3 * inner + out_depth))  # the last chunks' down products
    return {"steps": steps, "rows": rows, "step_bundles": others, "first_step_bundles": first,
            **_weights_in_first_step(schedule, steps, first, others, fill, later, step_bytes,
                                     first * last_share, block)}


def _weights_in_first_step(schedule: KernelSchedule, steps: int, first: float, others: float,
                           fill: float, later: float, step_bytes: float, tail: float,
                           drain: float) -> dict:
    """A kernel whose first step copies in the weights every step reads: its fill (`fill`
    bytes before anything overlaps them), its first step (the larger of its `first` bundles
    and the `later` bytes plus its share of the others, then the `tail` bundles after its
    last wait), each other step (the larger of its bundles and its share of the bytes), its
    drain (`drain` bytes after the last step) and its grid steps."""
    first_s = max(first / V6E.clock_hz, (later + step_bytes) / V6E.hbm_bytes_per_s
                  + tail / V6E.clock_hz)
    other_s = max(others / V6E.clock_hz, step_bytes / V6E.hbm_bytes_per_s)
    fill_s, drain_s = fill / V6E.hbm_bytes_per_s, drain / V6E.hbm_bytes_per_s
    return {"fill_s": fill_s, "drain_s": drain_s,
            "v6e_estimate_s": fill_s + first_s + (steps - 1) * other_s + drain_s
            + steps * V6E.grid_step_s
            + ((schedule.prologue if steps > 1 else 0) + schedule.epilogue) / V6E.clock_hz}


def _first_step_bundles(schedule: KernelSchedule, chunked: bool,
                        pages: PageRuns | None = None) -> tuple[float, float]:
    """Bundles of the first step and of each other step. With its first weight block in
    chunks (kernels.projection_kernel.first_chunk_columns), the kernel's step is two bodies
    under `pl.when`, the first step's then the others': read as the two sibling spans, one
    after the other, with the most bundles between them. Into pages, the branches that copy
    a page at a time are taken as `pages` says."""
    def page_branches(body: int | None) -> dict[int, float]:
        kids = range(len(schedule.spans)) if body is None else schedule.children(body)
        return {} if pages is None else {
            k: pages.share for k in kids if schedule.spans[k].dmas == pages.dmas}
    if not chunked:
        bundles = schedule.step_bundles(page_branches(None))
        return bundles, bundles
    spans = schedule.spans
    pairs = [(spans[i].bundles + spans[j].bundles, i, j) for i in range(len(spans))
             for j in range(i + 1, len(spans)) if spans[j].depth == spans[i].depth
             and all(spans[k].depth > spans[i].depth for k in range(i + 1, j))]
    if not pairs:
        raise ValueError(f"{schedule.name}: no first-step and other-step bodies in its step")
    _, i, j = max(pairs)
    return (schedule.step_bundles({j: 1} | page_branches(i)),
            schedule.step_bundles({i: 1} | page_branches(j)))


def kv_write_estimate(schedule: KernelSchedule, grid_steps: int, pages_per_step: int,
                      real_pages: int, page_bytes: int) -> dict:
    """The KV write: `grid_steps` steps, each looping over `pages_per_step` page slots (the
    loops' bound is a constant the listing does not show), copying K and V of the real pages
    HBM to HBM (read and written: twice their bytes through HBM)."""
    per_slot = {j: pages_per_step for j, (_, trips, _) in enumerate(schedule.inner_loops)
                if trips is None}
    step_bytes = 2 * 2 * real_pages * page_bytes / grid_steps
    return {"step_bundles": schedule.step_bundles(loop_trips=per_slot),
            "v6e_estimate_s": estimate_seconds(schedule, grid_steps, loop_trips=per_slot,
                                               step_bytes=step_bytes)}
