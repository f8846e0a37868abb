import json
import subprocess
import sys

from profiling.bench_engine import run


def test_bench_engine_measures_both_modes(engines):
    result = run(engines["qwen3"], query_tokens=12, item_tokens=3, num_items=4, num_labels=2,
                 repeats=1)
    assert set(result["modes"]) == {"multi_item", "prompt_per_item"}
    for row in result["modes"].values():
        assert row["latency_s"] > 0 and row["items_per_s"] == 4 / row["latency_s"]


def test_bench_engine_cli_writes_json(model_dirs, tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, "-m", "profiling.bench_engine", "--model_path",
                    model_dirs["llama"], "--query_tokens", "8", "--item_tokens", "2",
                    "--num_items", "3", "--repeats", "1", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    assert json.loads(out.read_text())["shape"]["num_items"] == 3
