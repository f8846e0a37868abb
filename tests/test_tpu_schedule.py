"""The static v6e cost model: the schedule listing's parser on a listing written here, and the
real compiler's schedules of kernels whose work is known."""
import dataclasses

import pytest

from kernels.attention_plan import BlockSizes, real_q_blocks, visited_tiles
from kernels.label_gather_kernel import streamed_cost
from kernels.ragged_paged_attention_kernel import whole_block_steps
from profiling.v6e.chip import V6E, V6eCosts
from profiling.v6e.kernel_estimates import label_gather_estimate
from profiling.v6e.schedule import (
    KernelSchedule,
    Span,
    compile_schedules,
    estimate_seconds,
    parse_bundles,
    schedule_of,
)

# The shape of a `...-final_bundles.txt` listing: a prologue, a grid loop (depth 1) holding a
# branch around a counted inner loop (4 trips), DMAs in and out, an epilogue; a bundle may
# run over several lines.
LISTING = """= control target key start
LB: loop body
= control target key end

     0   :  { %s1_s0 = inlined_call_operand.hbm [shape: bf16[8,128]] }
   0x1   :  { %2 = vsyncpa [#allocation4], 0 } /* Start region 1 */
   0x2 LB: > { %s3_s1 = sadd.s32 1, %s4_s1  ;;  %5 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s1_s0,
/*size_in_granules=*/64, /*vmem=*/%s6 } /* Start region 2 */
   0x3   : > { %7 = sbr.rel (%p8_p0) target = $region5 }
   0x4   : > { %v9_v0 = vld [vmem:[%s6] sm:$0xff]  ;;  %v10 = vpow2.f32 %v9_v0 }
   0x5 LB: >> { %v11 = vmatmul.mubr.bf16.gmra.mxu0 %v9_v0  ;;  %s12_s2 = sadd.s32 1, %s13_s2
  ;;  %p14_p1 = scmp.ge.s32.totalorder %s12_s2, 4 } /* Start region 7 */
   0x6   : >> { %v15 = vpop.f32.mrf.mxu0  ;;  %16 = sbr.rel (!%p14_p1) target = $region7 }
   0x7   : > { %17 = vst [vmem:[%s6] sm:$0xff] /*vst_source=*/%v15 }
   0x8 PF: > { %18 = dma.vmem_to_hbm [thread:$0]  /*vmem=*/%s6, /*size_in_granules=*/32,
/*hbm=*/%s1 } /* Start/End empty region 5 */
   0x9   : > { %19 = sbr.rel (!%p20_p2) target = $region2 }
   0xa   :  { %21 = vsyncpa [#allocation4], 1 }
"""


def _dump(tmp_path, listing: str, analysis: str | None):
    (tmp_path / "17-kernel_a-12-final_bundles.txt").write_text(listing)
    if analysis is not None:
        (tmp_path / "17-kernel_a-11-schedule-analysis_final_bundles.txt").write_text(analysis)
    return str(tmp_path)


def test_read_dumps_reads_a_kernel_whose_analysis_states_no_total(tmp_path):
    """Some schedule analyses of a program with a while loop have no total line."""
    from profiling.v6e.schedule import read_dumps
    without_total = read_dumps(_dump(tmp_path, LISTING, "critical path: 9\n"))
    assert without_total["kernel_a"].total_bundles == 11
    assert without_total["kernel_a"].step == 14


def test_read_dumps_refuses_a_listing_it_did_not_read_whole(tmp_path):
    from profiling.v6e.schedule import read_dumps
    with pytest.raises(ValueError, match="11 bundles read, the compiler's analysis says 12"):
        read_dumps(_dump(tmp_path, LISTING, "total scheduled bundles: 12\n"))
    with pytest.raises(ValueError, match="no bundles read"):
        read_dumps(_dump(tmp_path, "bundles in a form of a later compiler\n", None))


def test_a_listing_reads_as_prologue_step_and_epilogue():
    s = schedule_of("k", 11, parse_bundles(LISTING))
    assert (s.prologue, s.step, s.epilogue) == (2, 14, 1)  # the inner loop counts 4 times
    assert s.inner_loops == ((2, 4, 0),)
    assert s.step_hbm_dma_bytes == (64 + 32) * 32
    assert s.step_units == {"mxu": 8, "vpu": 0, "eup": 1, "xlu": 0, "vector_load": 1,
                            "vector_store": 1, "dma": 2, "scalar": 15}
    (span,) = s.spans  # the bundles the branch at 0x3 skips: 0x4 to 0x7
    assert (span.first, span.depth, span.bundles, span.hbm_dma_bytes) == (4, 0, 10, 0)
    assert s.step_bundles({0: 0.5}) == 9
    clock, step_s = 1e9, 1e-6
    chip = V6eCosts(clock, hbm_bytes_per_s=1e12, grid_step_s=0.0, xla_op_s=0.0)
    assert estimate_seconds(s, 10, chip) == pytest.approx(10 * 14 / clock + 3 / clock)
    slow_hbm = 3072 / (14 / clock) / 2  # DMAs take twice the bundles' time
    assert estimate_seconds(s, 10, dataclasses.replace(chip, hbm_bytes_per_s=slow_hbm)) == \
        pytest.approx(10 * 28 / clock + 3 / clock)
    assert estimate_seconds(s, 10, dataclasses.replace(chip, grid_step_s=step_s)) == \
        pytest.approx(estimate_seconds(s, 10, chip) + 10 * step_s)  # a fixed cost a step


def test_a_programs_listing_names_the_fusions_it_calls_either_way():
    """Small programs inline a fusion's call, larger ones call its address (Qwen3-4B's layer
    loop did: read as calling nothing, the loop was taken for a copy and dropped)."""
    listing = """   0x1   :  { %3 = inlined_call %s1_s0 /* %fusion.185 = fusion(%p.1) */ }
   0x2   :  { %3582 = call %s11556_s0, %s11557_s1 /* %gather_fusion.19 = fusion(%g.354) */ }
"""
    assert [b.calls for b in parse_bundles(listing)] == [("fusion.185",), ("gather_fusion.19",)]


def test_compiled_kernels_dma_the_bytes_of_their_blocks():
    """A Pallas matmul and copy through the real compiler: a step's DMAs move exactly its
    blocks, the MXU work of a step grows with its K block, and a copy is DMA-bound."""
    blocks = [dict(m=512, k=2048, n=512, bm=256, bk=bk, bn=256) for bk in (512, 1024)]
    matmuls = compile_schedules("profiling.v6e.calibrate:pallas_matmul", blocks)
    mxu = []
    for case, result in zip(blocks, matmuls):
        s = result["kernels"]["calibration_matmul"]
        bm, bk, bn = case["bm"], case["bk"], case["bn"]
        assert s.step_hbm_dma_bytes == 2 * (bm * bk + bk * bn + bm * bn)  # bf16 in, out
        assert s.step_units["eup"] == 0 and s.prologue + s.epilogue < s.step
        mxu.append(s.step_units["mxu"])
    assert 1.8 < mxu[1] / mxu[0] < 2.2, mxu
    (copy,) = compile_schedules("profiling.v6e.calibrate:pallas_copy",
                                [dict(rows=4096, cols=1024, block_rows=512)])
    s = copy["kernels"]["calibration_copy"]
    assert s.step_hbm_dma_bytes == 2 * 512 * 1024 * 4
    hbm_bound = 8 * (s.step_hbm_dma_bytes / V6E.hbm_bytes_per_s + V6E.grid_step_s)
    assert estimate_seconds(s, 8) == pytest.approx(hbm_bound, rel=0.02)


def test_the_attention_kernel_has_two_spans_that_run_once_per_q_block():
    """bench_attention weights the step's depth-2 spans (the first step's init, the last
    step's store) by how often they run: they must be there, and small."""
    (result,) = compile_schedules("profiling.bench_attention:kernel_case", [dict(
        shape="mis_120q_64x18", q_block=128, kv_block=512,
        heads=dict(q=16, kv=8, dim=128, page=128))])
    s = result["kernels"]["ragged_paged_attention"]
    once = [span for span in s.spans if span.depth == 2]
    assert len(once) == 2 and all(span.bundles < 0.1 * s.step for span in once), s.spans
    # K and V of a 512-token block in 128-token pages, both ways (whole, and a DMA a page),
    # for the step and the next one (started ahead; the first step's own start predicated)
    assert s.step_hbm_dma_bytes == 2 * 2 * 2 * 4 * 8 * 128 * 128 * 2


def test_the_attention_kernels_branches_are_priced_by_the_steps_that_run_them():
    """Pages of 16: the compiler branches around the first step's prefetch and the next's,
    and inside each around the copy a page (the whole block's copy is predicated); the
    step's work ends with the init, the tiles in bit order and the store. The estimate
    takes each branch's bundles off the steps that do not run it: here every block is
    whole (a sequence's pages follow each other), so no copy a page runs."""
    from profiling.bench_attention import SHAPES, Heads, _blocks, make_batch, pool_pages, work
    from profiling.v6e.kernel_estimates import attention_estimate
    heads, sizes = Heads(), BlockSizes(256, 256, tile=128)
    (result,) = compile_schedules("profiling.bench_attention:kernel_case", [dict(
        shape="mis_120q_64x18", q_block=256, kv_block=256, heads=dataclasses.asdict(heads),
        tile=128)])
    s = result["kernels"]["ragged_paged_attention"]
    first, nxt, step_work = [i for i, span in enumerate(s.spans) if span.depth == 1]
    init, *tiles, store = [s.spans[i] for i in s.children(step_work)]
    per_page = [(p, s.spans[k]) for p in (first, nxt) for k in s.children(p)]
    assert len(tiles) == 4 and min(t.bundles for t in tiles) > max(init.bundles, store.bundles)
    assert len(per_page) == 2 and all(span.dmas >= 32 for _, span in per_page)
    batch = make_batch(*SHAPES["mis_120q_64x18"], heads, sizes)[0]
    plan = batch.attention.plan
    steps, _, cost = work(batch, heads, sizes, 2)
    whole = whole_block_steps(plan, batch.attention, sizes, heads.page, pool_pages(batch, heads))
    got = attention_estimate(s, plan, steps, cost.bytes_accessed, _blocks(heads, sizes, 2),
                             whole)
    runs = visited_tiles(plan, sizes)
    assert whole == steps and got["tile_runs"] == runs and min(runs) < steps
    prefetch_runs = {first: 1, nxt: steps - 1}
    once = real_q_blocks(plan) / steps
    want = (s.step - s.spans[first].bundles * (1 - 1 / steps) - s.spans[nxt].bundles / steps
            - sum(span.bundles * prefetch_runs[p] / steps for p, span in per_page)
            - (init.bundles + store.bundles) * (1 - once)
            - sum(t.bundles * (1 - n / steps) for t, n in zip(tiles, runs)))
    assert got["step_bundles"] == pytest.approx(want)


def test_calibration_matmuls_agree_with_the_clock():
    """The clock constant holds for the first calibration matmul (each takes 10 s to compile
    twice): XLA's estimate for the dot and the kernel's bundles at the chip's clock within 10%."""
    from profiling.v6e.calibrate import MATMULS, matmul_rows
    for row in matmul_rows(MATMULS[:1]):
        assert row["bundles"] / V6E.clock_hz == pytest.approx(row["xla_optimal_s"], rel=0.1)


def test_a_general_dma_counts_where_one_end_is_an_hbm_address():
    """XLA's copies and transposes move HBM through strided `dma.general`s: their bytes count
    where the source or destination register holds an HBM address, not VMEM to VMEM."""
    listing = """   0x0   :  { %s5_s1 = scalar_lea.hbm %s1_s0, 64  ;;  %s7_s2 = int_to_ptr.vmem %s3 }
   0x1   :  { %6 = dma.general (%p1_p0), /*src=*/%s5_s1, /*size_in_granules=*/64,
/*dst=*/%s7_s2, /*dst_syncflagno=*/%s8_s4 }
   0x2   :  { %9 = dma.general (%p1_p0), /*src=*/%s7_s2, /*size_in_granules=*/32, /*dst=*/%s7_s2 }
"""
    bundles = parse_bundles(listing)
    assert [b.hbm_dma_bytes for b in bundles] == [0, 64 * 32, 0]


def test_a_loop_with_a_runtime_bound_counts_as_the_caller_says():
    listing = LISTING.replace("%s12_s2, 4 }", "%s12_s2, %s99_s3 }")
    s = schedule_of("k", 11, parse_bundles(listing))
    assert s.inner_loops == ((2, None, 0),) and s.step == 8  # counted once
    assert s.step_bundles(loop_trips={0: 4}) == 14


def test_a_pipelines_fill_and_drain_cost_their_bytes_unless_its_steps_wait_on_dmas():
    """The fill and drain bytes come out of the steps' share and are costed alone: on top
    where the steps are bound by their bundles, for nothing where by their DMAs."""
    s = KernelSchedule("k", total_bundles=1720, prologue=10, step=1700, epilogue=10,
                       step_units={}, step_hbm_dma_bytes=0, step_unsized_dmas=0, spans=(),
                       inner_loops=())
    chip = dataclasses.replace(V6E, clock_hz=1.7e9, grid_step_s=0.0)  # a step: 1 us
    us, ends = chip.hbm_bytes_per_s * 1e-6, 20 / chip.clock_hz

    def estimate(step_us, **kw):
        return estimate_seconds(s, 4, chip, step_bytes=step_us * us, **kw) - ends
    compute_bound = estimate(0.5, fill_bytes=us, drain_bytes=us)
    assert compute_bound == pytest.approx(estimate(0.5) + 2e-6) == pytest.approx(6e-6)
    assert estimate(2.0, fill_bytes=us, drain_bytes=us) == pytest.approx(estimate(2.0))


def test_label_gather_schedules_loop_over_labels_and_size_their_dmas():
    """Labels only: the loops that start a chunk's copies have a runtime bound (the chunk's
    (run, label) pairs), each trip a DMA of one tile of 8 head rows. Streamed over a vocabulary
    that ends in a partial tile: that tile's DMA has a runtime size, and the estimate asks for
    the step's bytes."""
    hidden = 256
    cases = [dict(mode=m, rows=16, vocab=5000, hidden=hidden, labels=2)
             for m in ("labels_only", "streamed_logsumexp")]
    rows, streamed = compile_schedules("profiling.bench_label_gather:kernel_case", cases)
    s = rows["kernels"]["label_gather_rows"]
    copying = [loop for loop in s.inner_loops if loop[2]]
    assert copying and all(trips is None and dma == 8 * hidden * 2 for _, trips, dma in copying)
    s = streamed["kernels"]["label_gather_streamed"]
    assert s.step_unsized_dmas > 0
    with pytest.raises(ValueError, match="runtime size"):
        estimate_seconds(s, 3)


def test_the_streamed_gather_costs_a_head_read_per_call_of_up_to_64_labels():
    """More than 64 labels take a streamed call per group of 64, each reading the whole head:
    the estimate and the cost add up the calls."""
    s = KernelSchedule("label_gather_streamed", total_bundles=40, prologue=10, step=30,
                       epilogue=10, step_units={}, step_hbm_dma_bytes=10**6,
                       step_unsized_dmas=0, spans=(), inner_loops=((4, None, 0),))

    def estimate(labels):
        return label_gather_estimate(s, "streamed_logsumexp", 16, 5000, 256, labels,
                                     kernel_bytes=0)["v6e_estimate_s"]
    assert estimate(128) == pytest.approx(2 * estimate(64))
    assert estimate(96) == pytest.approx(estimate(64) + estimate(32))
    head = 5000 * 256 * 2
    cost = [streamed_cost(16, n, 5000, 256, 16, 2) for n in (64, 128)]
    assert cost[1].bytes_accessed - cost[0].bytes_accessed >= head
    assert cost[1].flops == 2 * cost[0].flops


def test_jax_ragged_paged_attention_goes_through_the_same_estimate():
    """The peer check: JAX's own kernel compiles for v6e here, and its loop over the
    sequence's KV blocks is found and run once per KV block of every q block."""
    from kernels.attention_plan import BlockSizes
    from profiling.bench_attention import Heads, peer_estimate
    peer = peer_estimate(1024, Heads(page=128), BlockSizes(128, 512))
    assert peer["kv_blocks_visited"] == 8 * 2  # no causal skipping in that kernel
    assert peer["kv_block_bundles"] > 1000  # 8 KV heads of [256, 512] scores
    assert peer["v6e_estimate_s"] > 16 * peer["kv_block_bundles"] / V6E.clock_hz


def test_xla_prices_a_loop_body_once_and_a_pallas_call_by_its_cost_estimate():
    """Why the forward's estimate reads the whole program's schedule: XLA's cost_analysis()
    prices a 6-step loop of dots as one dot, and a Pallas call as the larger of its
    CostEstimate's FLOPs and bytes at XLA's rates (the figures profiling.v6e.compile keeps)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from profiling.v6e.calibrate import xla_dot, xla_dot_loop
    from profiling.v6e.compile import compile_for_v6e, xla_costs, xla_priced_s
    loop, one = (xla_costs(compile_for_v6e(fn, *args))
                 for fn, args in (xla_dot_loop(512, 512, 512, 6), xla_dot(512, 512, 512)))
    assert loop["flops"] == one["flops"] == 2 * 512 ** 3

    def doubled(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    for flops, hbm in ((10**10, 10**6), (10**9, 10**8)):
        def call(x, flops=flops, hbm=hbm):
            return pl.pallas_call(doubled, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                  cost_estimate=pl.CostEstimate(
                                      flops=flops, transcendentals=0, bytes_accessed=hbm))(x)
        costs = xla_costs(compile_for_v6e(call, jax.ShapeDtypeStruct((8, 128), jnp.float32)))
        assert costs["optimal_s"] == pytest.approx(xla_priced_s(flops, hbm), rel=1e-3)


def test_the_compiling_child_starts_in_the_repository_root():
    """Builders are named from the repository root (a checkout beside another, say)."""
    import os

    from profiling.v6e.schedule import _repository_root
    assert os.path.isfile(os.path.join(_repository_root(), "profiling", "v6e", "schedule.py"))


def test_a_programs_layer_loop_runs_its_trips():
    """The whole-program reading: the level holding the loop's dot runs once per layer, so the
    estimate grows by one level per layer (XLA's own stays flat)."""
    from profiling.v6e.hlo_ops import op_facts
    from profiling.v6e.program_schedule import level_from_json, program_seconds
    results = compile_schedules("profiling.v6e.calibrate:xla_dot_loop",
                                [dict(m=1024, k=1024, n=1024, layers=n) for n in (3, 6)],
                                program=True)
    levels = [[level_from_json(x) for x in r["levels"]] for r in results]
    assert [[level.trips for level in lv] for lv in levels] == [[1, 3], [1, 6]]
    per_layer = levels[1][1].seconds({})
    assert any(cost.hbm_bytes == 1024 * 1024 * 2 for cost in levels[1][1].calls.values())
    grown = program_seconds(levels[1], {}) - program_seconds(levels[0], {})
    assert grown == pytest.approx(3 * per_layer, rel=0.01)
    assert results[0]["xla"]["optimal_s"] == results[1]["xla"]["optimal_s"]
    # what each callee does, from the optimized HLO: the layer's one dot, by its FLOPs
    facts = op_facts(results[1]["hlo"])
    assert sorted(facts[name].flops for name in levels[1][1].calls)[-1] == 2 * 1024 ** 3
    assert sum(facts[name].flops for name in levels[1][1].calls) == 2 * 1024 ** 3


def test_the_forwards_estimate_prices_every_layer_and_its_kernels(capsys):
    """The embedded model's program for a bucket of SGLang-shaped sequences, as
    forward_breakdown estimates and prints it: its layer level runs once per layer and calls
    the attention, KV-write and norm-and-RoPE kernels, priced at the batch's real steps; the
    estimate is above the roofline of the work."""
    from profiling.bench_forward import layer_flops
    from profiling.v6e.compile import SIZED_MODELS
    from profiling.v6e.forward_breakdown import breakdown, print_breakdown
    cfg = SIZED_MODELS["SmolLM2-135M"]
    est = breakdown("SmolLM2-135M", 128)
    print_breakdown(est)
    assert "layer/mlp/dot_general" in capsys.readouterr().out
    assert 0 < est["roofline_s"] < est["seconds"]
    assert est["fraction_of_roofline"] == pytest.approx(est["roofline_s"] / est["seconds"])
    outside, layer = est["levels"]
    assert (outside["trips"], layer["trips"]) == (1, cfg.num_layers)
    kernels = est["kernels"]
    assert layer["kernels_s"] == pytest.approx(kernels["attention"]["v6e_estimate_s"]
                                               + kernels["kv_write"]["v6e_estimate_s"]
                                               + kernels["rope"]["v6e_estimate_s"])
    assert kernels["rope"]["steps"] >= 1
    assert outside["kernels_s"] == pytest.approx(kernels["gather"]["v6e_estimate_s"])
    assert layer["xla_bundles"] > 0 and layer["xla_hbm_bytes"] > 0
    # each XLA op of the layer named by its scope, the projections' and MLP's FLOPs in dots
    scopes = [op["scope"] for op in layer["xla_ops"]]
    assert any("layer/mlp/dot_general" in s for s in scopes)
    assert not any("qk_norm_rope" in s for s in scopes)  # priced as a kernel
    dot_flops = sum(op["flops"] for op in layer["xla_ops"])  # of ops of 500 bundles or more:
    # at 128 tokens SmolLM2's k and v projections are below, 6% of the layer's FLOPs
    assert 0.9 < dot_flops / layer_flops(cfg, est["shape"]["tokens"]) <= 1
    mlp_weights = 2 * cfg.num_layers * 3 * cfg.hidden_size * cfg.intermediate_size
    assert est["seconds"] > mlp_weights / V6E.hbm_bytes_per_s


def test_a_projections_page_by_page_branch_is_priced_in_the_steps_that_take_it():
    """k's and v's projection into pages: each body (the first step's, the others') holds a
    branch that copies the pages one by one (2 DMAs a page), taken where a step's pages do
    not follow each other; the first and other steps are priced with it at that share."""
    from profiling.v6e.kernel_estimates import PageRuns, _first_step_bundles
    spans = (Span(first=0, depth=0, bundles=2000, hbm_dma_bytes=0, end=2000, dmas=130),
             Span(first=10, depth=1, bundles=1100, hbm_dma_bytes=0, end=1110, dmas=66),
             Span(first=900, depth=2, bundles=200, hbm_dma_bytes=0, end=1100, dmas=64),
             Span(first=1110, depth=1, bundles=880, hbm_dma_bytes=0, end=1990, dmas=64),
             Span(first=1700, depth=2, bundles=200, hbm_dma_bytes=0, end=1900, dmas=64))
    s = KernelSchedule("project_kv", total_bundles=2020, prologue=10, step=2000, epilogue=10,
                       step_units={}, step_hbm_dma_bytes=0, step_unsized_dmas=0, spans=spans,
                       inner_loops=())
    assert _first_step_bundles(s, True) == (2000 - 880, 2000 - 1100)  # every branch taken
    assert _first_step_bundles(s, True, PageRuns(64, 1.0)) == (2000 - 880 - 200,
                                                               2000 - 1100 - 200)
    assert _first_step_bundles(s, True, PageRuns(64, 0.25)) == (2000 - 880 - 50,
                                                                2000 - 1100 - 50)
    with pytest.raises(ValueError, match="no first-step and other-step bodies"):
        _first_step_bundles(dataclasses.replace(s, spans=spans[:3]), True)
