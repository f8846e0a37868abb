"""The batch command (`python -m server.batch`): OpenAI's batch lines in, one result each out,
the bodies the HTTP routes answer, bad lines as error results, and a restart after a kill
(SIGKILL included) that scores only the lines without a result."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from runtime.engine import Engine
from server.app import ServerConfig
from server.batch import Progress
from server.batch_job import (
    Counts,
    ResultLog,
    jsonl_lines,
    parquet_row_count,
    parquet_rows,
    routes,
    run_job,
)
from tests.assertions import assert_scores_close
from tests.server_harness import call, serving
from tests.tiny_models import small_config, write_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCORE = {"query": "Tokyo is a city", "items": [" in Japan", " in France"],
         "label_token_ids": [5, 17]}
RERANK = {"query": "capital of France?", "documents": ["Paris is its capital.", "Tokyo."]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("batch") / "qwen3"), "qwen3", 7,
                            max_position_embeddings=1024)


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = Engine.from_path(checkpoint, small_config(max_prefill_tokens=512))
    yield engine
    engine.close()


def request(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def run(engine, tmp_path, lines: list[str], max_in_flight=8) -> tuple[list[dict], Counts]:
    tmp_path.mkdir(exist_ok=True)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(line + "\n" for line in lines))
    job_routes = routes(engine, "tiny")
    with ResultLog(str(out)) as log:
        counts = run_job(jsonl_lines(str(src), job_routes), log, job_routes, max_in_flight)
    return [json.loads(line) for line in out.read_text().splitlines()], counts


def by_line(results: list[dict]) -> dict[int, dict]:
    indices = [int(r["id"].removeprefix("batch_req_")) for r in results]
    assert len(set(indices)) == len(indices), "a line answered twice"
    return dict(zip(indices, results))


def test_results_are_what_the_http_routes_answer(engine, tmp_path):
    bodies = [("/v1/score", SCORE), ("/v1/score", {**SCORE, "apply_softmax": True}),
              ("/v1/score", {"query": [1, 2, 3], "items": [[4, 5], [6]],
                             "label_token_ids": [7]}),
              ("/v1/rerank", RERANK), ("/v2/rerank", {**RERANK, "top_n": 1})]
    results, counts = run(engine, tmp_path, [request(f"r{k}", url, body)
                                             for k, (url, body) in enumerate(bodies)])
    got = by_line(results)
    assert sorted(got) == list(range(len(bodies))) and counts.failed == 0
    assert counts.items == 2 + 2 + 2 + 2 + 2
    with serving(engine, ServerConfig(model_name="tiny")) as port:
        for k, (url, body) in enumerate(bodies):
            status, want, _ = call(port, "POST", url, body)
            answer = got[k]["response"]
            assert got[k]["custom_id"] == f"r{k}" and got[k]["error"] is None
            assert answer["status_code"] == status == 200
            assert_same_answer(answer["body"], want)


def assert_same_answer(got: dict, want: dict) -> None:
    """The same body but the rerank id (new each time); scores as close as a forward of
    another shape makes them (the job's lines share forwards as they come)."""
    if "scores" in want:
        assert_scores_close(got["scores"], want["scores"])
    else:
        assert [r["index"] for r in got["results"]] == [r["index"] for r in want["results"]]
        assert_scores_close([r["relevance_score"] for r in got["results"]],
                            [r["relevance_score"] for r in want["results"]])
    drop = {"id": None, "scores": None, "results": None}
    assert {**got, **drop} == {**want, **drop}


def test_bad_lines_get_error_results_and_the_run_goes_on(engine, tmp_path):
    lines = [request("good", "/v1/score", SCORE),
             '{"custom_id": "cut", "url": "/v1/sco',
             "[1, 2]",
             request("where", "/v1/chat/completions", SCORE),
             request("get", "/v1/score", SCORE, method="GET"),
             json.dumps({"custom_id": "nobody", "url": "/v1/score"}),
             request("refused", "/v1/score", {"items": ["a"]}),
             request("long", "/v1/score", {**SCORE, "query": "word " * 5000}),
             request("also good", "/v1/rerank", RERANK)]
    results, counts = run(engine, tmp_path, lines)
    got = by_line(results)
    assert sorted(got) == list(range(len(lines))) and counts.failed == len(lines) - 2
    for k in (0, 8):
        assert got[k]["response"]["status_code"] == 200 and got[k]["error"] is None
    for k, words in [(1, "invalid JSON"), (2, "JSON object"), (3, "/v1/chat/completions"),
                     (4, "'GET'"), (5, "no body")]:
        assert got[k]["response"] is None and words in got[k]["error"]["message"]
        assert f"line {k + 1}" in got[k]["error"]["message"]
    assert got[3]["custom_id"] == "where"
    with serving(engine) as port:
        for k in (6, 7):  # refused by the route: its own answer, as over HTTP
            status, want, _ = call(port, "POST", "/v1/score", json.loads(lines[k])["body"])
            assert got[k]["response"] == {"status_code": status, "body": want} and status == 400


def test_a_restart_scores_only_the_lines_without_a_whole_result(engine, tmp_path):
    """Results already written stand (their bodies are not recomputed); a last line cut
    short is not a result."""
    lines = [request(f"r{k}", "/v1/score", {**SCORE, "query": f"query {k}"}) for k in range(6)]
    earlier = [{"id": f"batch_req_{k}", "custom_id": f"r{k}",
                "response": {"status_code": 200, "body": {"scores": "from before"}},
                "error": None} for k in (1, 4)]
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in earlier) + '{"id": "batch_req_2", "cu')
    results, counts = run(engine, tmp_path, lines)
    got = by_line(results)
    assert sorted(got) == list(range(6)) and counts.requests == 4
    assert [got[k] for k in (1, 4)] == earlier
    assert all(isinstance(got[k]["response"]["body"]["scores"], list) for k in (0, 2, 3, 5))


@pytest.mark.parametrize("text", ['{"not": "a result"}\n', "[1]\n", "garbage\n",
                                  '{"id": "batch_req_0"}\n{"id": "batch_req_x"}\n'])
def test_an_output_that_is_not_a_batch_result_is_refused_and_kept(tmp_path, text):
    out = tmp_path / "out.jsonl"
    out.write_text(text)
    with pytest.raises(ValueError, match="not a batch result"):
        ResultLog(str(out))
    assert out.read_text() == text


def test_the_command_names_a_missing_input_before_loading_a_model(tmp_path):
    done = subprocess.run(batch_command("/nonexistent", tmp_path / "none.jsonl",
                                        tmp_path / "out.jsonl"),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "none.jsonl" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out.jsonl").exists()


def test_progress_says_what_is_done_and_what_is_left():
    line = Progress(total=100, done_before=20).line(Counts(requests=30, items=300, failed=2), 3.0)
    assert line.startswith("50/100 requests (2 failed), 300 items, 100 items/s, 5 s left")


def batch_command(checkpoint: str, src, out) -> list[str]:
    return [sys.executable, "-m", "server.batch", f"--model-path={checkpoint}",
            f"--input={src}", f"--output={out}", "--compile-cache-dir=", "--max-in-flight=4",
            "--max-prefill-tokens=256", "--page-size=8", "--max-seqs=8", "--skip-warmup"]


def test_the_command_killed_and_started_again_writes_each_result_once(checkpoint, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    n = 120
    src.write_text("".join(request(f"r{k}", "/v1/score", {**SCORE, "query": f"q{k} " * 30})
                           + "\n" for k in range(n)))
    job = subprocess.Popen(batch_command(checkpoint, src, out), cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while (not out.exists() or out.read_text().count("\n") < 10) and job.poll() is None:
        assert time.monotonic() < deadline, "no results within 120 s"
        time.sleep(0.05)
    job.send_signal(signal.SIGKILL)
    job.wait()
    first = out.read_text().count("\n")
    assert 10 <= first < n, "killed before or after the whole job"
    done = subprocess.run(batch_command(checkpoint, src, out), cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    got = by_line(results)
    assert sorted(got) == list(range(n))
    assert all(r["response"]["status_code"] == 200 for r in results)
    assert f"{n - first} results written" in done.stderr


def test_parquet_rows_are_score_requests(engine, tmp_path):
    """A Parquet file of query / items / label_token_ids rows (custom_id optional): row n
    answers as line n of the same requests as JSONL."""
    import pyarrow
    import pyarrow.parquet
    rows = [{**SCORE, "query": f"query {k}"} for k in range(5)]
    path = tmp_path / "in.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path, row_group_size=2)
    with ResultLog(str(tmp_path / "out.jsonl")) as log:
        counts = run_job(parquet_rows(str(path)), log, routes(engine, "tiny"), 4)
    got = by_line([json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()])
    want, _ = run(engine, tmp_path / "jsonl", [request(str(k), "/v1/score", row)
                                                for k, row in enumerate(rows)])
    assert parquet_row_count(str(path)) == 5 and counts.requests == 5 and counts.failed == 0
    want = by_line(want)
    assert sorted(got) == sorted(want)
    for k, line in got.items():
        assert_same_answer(line["response"].pop("body"), want[k]["response"].pop("body"))
        assert line == want[k]


def test_a_parquet_file_without_the_columns_is_refused(tmp_path):
    import pyarrow
    import pyarrow.parquet
    path = tmp_path / "in.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([{"query": "q", "items": ["a"]}]),
                                path)
    with pytest.raises(ValueError, match="lacks label_token_ids"):
        parquet_row_count(str(path))


def test_a_large_input_is_streamed_not_loaded(tmp_path):
    """25,000 request lines (50 MB) through the job with a route that answers at once: the
    memory it holds stays a small part of the file's size (the lines in flight, the results
    being written, a bit a line for which are done)."""
    import concurrent.futures
    import tracemalloc
    from server.batch_job import Route

    def answered(request):
        future = concurrent.futures.Future()
        future.set_result(len(request["items"]))
        return future

    route = Route(lambda body: body, answered, lambda req, n: {"items": n}, lambda req: 1)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    padding = "x" * 2000
    with open(src, "w") as f:
        for k in range(25_000):
            f.write(request(str(k), "/v1/score", {"query": padding, "items": [str(k)]}) + "\n")
    size = src.stat().st_size
    tracemalloc.start()
    try:
        with ResultLog(str(out)) as log:
            counts = run_job(jsonl_lines(str(src), {"/v1/score"}), log, {"/v1/score": route},
                             64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert counts.requests == 25_000 and counts.failed == 0 and size > 45e6
    # 2% of the file: a line that left 25 bytes behind would fail it
    assert peak < size / 50, f"{peak / 1e6:.1f} MB held for a {size / 1e6:.0f} MB input"
    assert sum(1 for _ in open(out)) == 25_000


def test_progress_is_a_line_rewritten_on_a_terminal_and_nothing_elsewhere():
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal, pipe = Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        progress = Progress(total=10, done_before=0, stream=stream, every_s=0.0)
        progress(Counts(requests=4, items=40))
        progress(Counts(requests=10, items=100), final=True)
    assert terminal.getvalue().startswith("\r4/10 requests (0 failed), 40 items")
    assert "\r10/10 requests" in terminal.getvalue() and terminal.getvalue().endswith("\n")
    assert pipe.getvalue() == ""


def test_a_request_that_raises_fails_its_own_line_only(tmp_path):
    """A bug met while submitting or answering one request is that line's 500, as over HTTP;
    the lines around it are answered."""
    import concurrent.futures
    from server.batch_job import Route

    def submit(request):
        if request["query"] == "raise on submit":
            raise RuntimeError("submit broke")
        future = concurrent.futures.Future()
        if request["query"] == "raise on answer":
            future.set_exception(RuntimeError("forward broke"))
        else:
            future.set_result(1)
        return future

    route = Route(lambda body: body, submit, lambda req, n: {"n": n}, lambda req: 1)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(request(q, "/v1/score", {"query": q}) + "\n" for q in
                           ["fine", "raise on submit", "raise on answer", "fine too"]))
    with ResultLog(str(out)) as log:
        counts = run_job(jsonl_lines(str(src), {"/v1/score"}), log, {"/v1/score": route}, 4)
    got = by_line([json.loads(x) for x in out.read_text().splitlines()])
    assert counts.requests == 4 and counts.failed == 2
    assert [got[k]["response"]["status_code"] for k in range(4)] == [200, 500, 500, 200]
    assert "submit broke" in got[1]["response"]["body"]["message"]
    assert "forward broke" in got[2]["response"]["body"]["message"]
