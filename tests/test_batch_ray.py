"""The batch job under Ray Data (the `batch` extra): a local cluster of 2 CPUs, 2 engine actors,
shards by file and by runs of lines; its results are the single-process job's, and a run
again after a shard was cut short redoes only that shard's missing lines."""
import json

import numpy as np
import pytest

from runtime.engine import Engine
from server.batch_job import ResultLog, jsonl_lines, routes, run_job
from server.batch_ray import run_ray_job, shards
from tests.tiny_models import small_config, write_checkpoint

SCORE = {"items": [" in Japan", " in France", " on Mars"], "label_token_ids": [5, 17]}


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)  # 2 actors, 1 reader
    yield ray
    ray.shutdown()


def write_inputs(directory, files: int, lines: int) -> list[str]:
    paths = []
    for f in range(files):
        path = directory / f"part{f}.jsonl"
        path.write_text("".join(json.dumps({
            "custom_id": f"{f}-{k}", "method": "POST", "url": "/v1/score",
            "body": {**SCORE, "query": f"file {f} query {k} " * (1 + k % 4)}}) + "\n"
            for k in range(lines)))
        paths.append(str(path))
    return paths


def scores(path) -> dict:
    out = {}
    for line in open(path):
        result = json.loads(line)
        out[result["custom_id"]] = np.asarray(result["response"]["body"]["scores"])
    return out


def test_ray_job_equals_the_single_process_job_and_resumes(ray_cluster, tmp_path):
    checkpoint = write_checkpoint(str(tmp_path / "qwen3"), "qwen3", 3)
    cfg = small_config(max_prefill_tokens=256)
    inputs = write_inputs(tmp_path, files=2, lines=12)
    jobs = shards(inputs, str(tmp_path), lines_per_shard=5)
    assert [(s.first, s.end) for s in jobs[:3]] == [(0, 5), (5, 10), (10, 15)]
    counts = run_ray_job(jobs, checkpoint, cfg, actors=2, max_in_flight=8)
    assert sum(c["requests"] for c in counts) == 24 and sum(c["failed"] for c in counts) == 0

    engine = Engine.from_path(checkpoint, cfg)
    try:
        job_routes = routes(engine, "tiny")
        for path in inputs:  # a result file per input file: each counts its own lines
            with ResultLog(path + ".alone") as log:
                run_job(jsonl_lines(path, job_routes), log, job_routes, 8)
    finally:
        engine.close()
    alone = {k: v for path in inputs for k, v in scores(path + ".alone").items()}
    got = {k: v for s in jobs for k, v in scores(s.output).items()}
    assert sorted(got) == sorted(alone)
    for key, want in alone.items():  # other forwards pack them otherwise: float tolerance
        np.testing.assert_allclose(got[key], want, rtol=1e-5, atol=1e-6)

    cut = jobs[1].output
    lines = open(cut).read().splitlines(keepends=True)
    open(cut, "w").write("".join(lines[:2]) + lines[2][:10])  # killed mid-line
    again = run_ray_job(jobs, checkpoint, cfg, actors=2, max_in_flight=8)
    assert sum(c["requests"] for c in again) == 3
    assert scores(cut).keys() == {f"0-{k}" for k in range(5, 10)}


def test_the_command_runs_a_glob_of_files_on_ray(tmp_path):
    """`python -m server.batch --ray-actors 2`: a local cluster, a result file per shard,
    every line answered."""
    import subprocess
    import sys
    checkpoint = write_checkpoint(str(tmp_path / "qwen3"), "qwen3", 3)
    write_inputs(tmp_path, files=2, lines=6)
    out = tmp_path / "results"
    done = subprocess.run([
        sys.executable, "-m", "server.batch", f"--model-path={checkpoint}",
        f"--input={tmp_path}/part*.jsonl", f"--output={out}", "--ray-actors=2",
        "--ray-lines-per-shard=4", "--compile-cache-dir=", "--max-prefill-tokens=256",
        "--page-size=8", "--max-seqs=8", "--skip-warmup"], capture_output=True, text=True,
        timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        f"part{f}.jsonl.{first}.jsonl" for f in range(2) for first in (0, 4)]
    got = {k for path in out.iterdir() for k in scores(path)}
    assert got == {f"{f}-{k}" for f in range(2) for k in range(6)}
    assert "4 shards: 12 results written (0 failed, 36 items)" in done.stderr
