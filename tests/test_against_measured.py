"""The v6e estimate held against real measurements (profiling.v6e.against_measured): the case
file, the splash kernel's grid, the fit, and the study on a case compiled here."""
import dataclasses
import json
import subprocess
import sys

import pytest

from profiling.v6e.chip import V6eCosts
from profiling.v6e.measured_cases import (
    CASE_FILE,
    TOKAMAX_FILES,
    load_cases,
    tokamax_cases,
)
from profiling.v6e.measured_programs import FLASH, splash_runs
from profiling.v6e.schedule import KernelSchedule, Span


def _attention_spec(q: str, causal: bool, residuals: bool = False) -> dict:
    return {"q": q, "k": q, "v": q, "logits_scale": 0.125, "bias": None,
            "mask": {"bool_mask": None, "is_causal": causal},
            "return_residuals": residuals}


def test_tokamax_cache_files_become_cases_with_at_most_half_to_fit(tmp_path):
    spec = json.dumps(_attention_spec("bf16[2,512,4,128]", True))
    timed = {"evaluation_times_ms": [1.0, 1.2, 1.1, 1.1, 1.3]}
    cache = {spec: {json.dumps({"block_q": 256}): timed, json.dumps({"block_q": 512}): timed},
             json.dumps(_attention_spec("bf16[1,512,4,128]", False)): {}}  # never timed
    for name in TOKAMAX_FILES:
        (tmp_path / name).write_text(json.dumps(cache))
    cases = tokamax_cases(str(tmp_path), "tokamax-test")
    assert len(cases) == 2 * len(TOKAMAX_FILES)
    assert [c["split"] for c in cases[:2]] == ["held_out", "fit"]
    assert {c["program"] for c in cases} == set(TOKAMAX_FILES.values())
    assert cases[0]["arguments"]["q"] == "bf16[2,512,4,128]"
    assert cases[1]["config"] == {"block_q": 512}


def test_the_shipped_case_file_cites_its_source_and_fits_on_at_most_half():
    sources, cases = load_cases()
    (source,) = sources.values()
    assert source["commit"].startswith("99ee973") and "tokamax" in source["repository"]
    by_file = {}
    for case in cases:
        by_file.setdefault(case.file, []).append(case)
        assert len(case.measured_ms) == 5 and case.measured_s > 0
    assert {f.rsplit("/", 1)[1]: len(c) for f, c in by_file.items()} == {
        "pallas_mosaic_tpu_flash_attention.json": 70,
        "xla_chunked_dot_product_attention.json": 129,
        "chunked_xla_linear_softmax_cross_entropy_loss.json": 35}
    for file_cases in by_file.values():
        assert 2 * sum(c.split == "fit" for c in file_cases) <= len(file_cases)


def test_a_case_file_naming_an_unknown_source_or_split_is_refused(tmp_path):
    sources, cases = load_cases()
    case = dataclasses.asdict(cases[0])
    for bad, match in ((dict(source="elsewhere"), "names source"),
                       (dict(split="train"), "has split")):
        path = tmp_path / "cases.json"
        path.write_text(json.dumps({"sources": sources, "cases": [{**case, **bad}]}))
        with pytest.raises(ValueError, match=match):
            load_cases(str(path))


def _splash_schedule(children: int) -> KernelSchedule:
    spans = (Span(10, 0, 1000, 0, 1010),) + tuple(
        Span(20 + 100 * i, 1, 50, 0, 70 + 100 * i) for i in range(children))
    return KernelSchedule("splash", 1100, 10, 1050, 10, {}, 0, 0, spans, ())


def test_splash_grid_runs_the_blocks_a_causal_mask_leaves_and_their_branches():
    """4096 tokens in blocks of 1024, causal: 10 of 16 blocks run (tokamax lists them), 4 on
    the diagonal take the masked branch; a row's init and finalize run once per row."""
    arguments = _attention_spec("bf16[2,4096,4,128]", True)
    config = {"block_q": 1024, "block_kv": 1024}
    runs = splash_runs(arguments, config, _splash_schedule(4))
    grids = 2 * 4
    assert runs.steps == grids * 10
    rows = grids * 4
    assert runs.skipped == pytest.approx({1: 1 - rows / runs.steps, 2: 4 / 10, 3: 6 / 10,
                                          4: 1 - rows / runs.steps})
    block = 1024 * 128 * 2
    # a q block and an output block per row; K and V for every block but row 1's first, the
    # block row 0 ended on
    kv_copies = runs.steps - grids
    assert runs.step_bytes * runs.steps == pytest.approx((2 * rows + 2 * kv_copies) * block)
    assert (runs.fill_bytes, runs.drain_bytes) == (3 * block, block)
    # JAX's kernel runs all 16 blocks, the 6 no query sees without their compute
    jax_runs = splash_runs(arguments, config, _splash_schedule(3), stand_in=True)
    assert jax_runs.steps == grids * 16
    assert jax_runs.skipped[2] == pytest.approx(6 / 16)


def test_the_fit_finds_the_costs_its_cases_were_made_with():
    """Cases whose measurements are the model's own at known costs: the grid search over the
    clock and HBM rate, and least squares for the fixed costs, find them again."""
    truth = V6eCosts(1.80e9, 1.40e12, grid_step_s=0.4e-6, xla_op_s=1e-6)

    @dataclasses.dataclass(frozen=True)
    class Part:  # a program of `steps` grid steps and `xla_ops` ops, compute or DMA bound
        bundles: float
        hbm_bytes: float
        steps: int
        xla_ops: int

        def seconds(self, costs):
            total = (costs.overlapped(self.bundles, self.hbm_bytes)
                     + self.steps * costs.grid_step_s + self.xla_ops * costs.xla_op_s)
            return total, total

        @property
        def case(self):
            return type("Case", (), {"measured_s": self.seconds(truth)[1]})

    from profiling.v6e.against_measured import fit
    parts = [Part(b, B, s, n) for b, B, s, n in [(4e6, 1e9, 100, 3), (1e6, 4e9, 2000, 1),
                                                 (9e6, 2e8, 50, 40), (2e5, 3e8, 800, 7),
                                                 (3e6, 6e9, 10, 2)]]
    costs, error = fit(parts)
    assert error < 1e-3
    assert costs.clock_hz == pytest.approx(truth.clock_hz, rel=0.01)
    assert costs.hbm_bytes_per_s == pytest.approx(truth.hbm_bytes_per_s, rel=0.02)
    assert costs.grid_step_s == pytest.approx(truth.grid_step_s, rel=0.05)
    assert costs.xla_op_s == pytest.approx(truth.xla_op_s, rel=0.05)


def test_the_study_compiles_a_measured_case_and_prints_it_beside_its_measurement(tmp_path):
    """One flash attention case, compiled here with JAX's splash attention (the stand-in for
    tokamax's): its grid steps, its estimate and its ratio to what the chip measured."""
    sources, cases = load_cases(CASE_FILE)
    case = next(c for c in cases if c.program == FLASH
                and c.arguments["q"] == "bf16[32,512,16,128]"
                and not c.arguments["mask"]["is_causal"] and not c.arguments["return_residuals"])
    path, out = tmp_path / "one.json", tmp_path / "out.json"
    path.write_text(json.dumps({"sources": sources, "cases": [dataclasses.asdict(case)]}))
    done = subprocess.run(
        [sys.executable, "-m", "profiling.v6e.against_measured", "--cases", str(path),
         "--stand_in", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert case.name in done.stdout and "JAX stand-ins" in done.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["steps"] == 32 * 16  # one block a (batch, head)
    assert row["measured_s"] == pytest.approx(case.measured_s)
    assert 0 < row["kernel_s"] < row["estimate_s"]
    assert row["ratio"] == pytest.approx(row["estimate_s"] / row["measured_s"])
    assert 0.6 < row["ratio"] < 1.6
