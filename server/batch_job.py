"""A batch job on the engine (CONTRACT §9): request lines in, one result line each out, in
OpenAI's batch file format (vLLM's `run-batch`), resumable.

An input line is `{"custom_id", "method": "POST", "url": "/v1/score" | "/v1/rerank", "body"}`;
its result line is `{"id", "custom_id", "response": {"status_code", "body"}, "error"}`, the
body what the HTTP route answers. The output file is the job's record: a result is done once
its whole line is written, so a job killed at any moment and started again scores the lines
without one, and a last line cut short is dropped. Results are written as they finish, not in
input order; `id` names the input line (`batch_req_<n>`, from 0).
"""
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import os
import re
import time
from typing import Callable, Iterable, Iterator, NamedTuple

from runtime.engine import Engine
from runtime.errors import ScoreError
from runtime.request import parse_rerank_request, parse_score_request
from server.app import RERANK_ROUTES, rerank_response, score_response
from server.http import error_body
from server.json_codec import parse_json

_ID = re.compile(r"batch_req_(\d+)$")


@dataclasses.dataclass(frozen=True)
class BatchLine:
    """One input line (or Parquet row): a request, or why it is none."""
    index: int
    custom_id: object = None
    url: str = ""
    body: object = None
    error: str | None = None  # the line is not a request: its error result says why


@dataclasses.dataclass(frozen=True)
class Route:
    parse: Callable      # body -> request (ScoreError if the route would refuse it)
    submit: Callable     # request -> concurrent.futures.Future
    respond: Callable    # (request, result) -> response body
    items: Callable      # request -> items it scores


def routes(engine: Engine, model_name: str) -> dict[str, Route]:
    """The HTTP server's scoring routes, on `engine`, answering as `model_name`."""
    score = Route(lambda body: parse_score_request(body, not engine.cfg.is_classifier),
                  engine.submit, functools.partial(score_response, model=model_name),
                  lambda req: len(req.items))
    rerank = Route(parse_rerank_request, engine.submit_rerank,
                   functools.partial(rerank_response, model=model_name),
                   lambda req: len(req.documents))
    return {"/v1/score": score, **{path: rerank for path in RERANK_ROUTES}}


def request_line(index: int, raw: bytes, urls) -> BatchLine:
    """Input line `index`, checked as far as the batch format goes (the route checks its
    body)."""
    try:
        line = parse_json(raw)
    except ScoreError as e:
        return BatchLine(index, error=f"line {index + 1}: {e.message}")
    if not isinstance(line, dict):
        return BatchLine(index, error=f"line {index + 1}: a request line is a JSON object")
    custom_id, url, method = line.get("custom_id"), line.get("url"), line.get("method", "POST")
    if url not in urls:
        return BatchLine(index, custom_id, error=f"line {index + 1}: url {url!r} is none of "
                                                 f"{', '.join(sorted(urls))}")
    if method != "POST":
        return BatchLine(index, custom_id, error=f"line {index + 1}: method {method!r}: "
                                                 f"{url} takes POST")
    if "body" not in line:
        return BatchLine(index, custom_id, error=f"line {index + 1}: no body")
    return BatchLine(index, custom_id, url, line["body"])


def jsonl_lines(path: str, urls, first: int = 0, end: int | None = None) -> Iterator[BatchLine]:
    """The file's request lines (those of lines [first, end)), read as they are needed; blank
    lines are not requests."""
    with open(path, "rb") as f:
        for index, raw in enumerate(itertools.islice(f, end)):
            if index >= first and raw.strip():
                yield request_line(index, raw, urls)


def _result_index(raw: bytes, path: str) -> int:
    """The input line a whole line of an output file answers."""
    try:
        result = json.loads(raw)
    except ValueError:
        result = None
    match = _ID.match(str(result.get("id"))) if isinstance(result, dict) else None
    if match is None:
        raise ValueError(f"{path} holds a line that is not a batch result: {raw[:80]!r}")
    return int(match.group(1))


PARQUET_COLUMNS = ("query", "items", "label_token_ids")  # and, if there, custom_id,
#                                                         apply_softmax and item_first


def parquet_rows(path: str, urls=None) -> Iterator[BatchLine]:
    """A Parquet file's rows as /v1/score requests, read a record batch at a time (pyarrow, the
    `batch` extra); row n's result is line n's."""
    del urls  # every row is a /v1/score request
    table = _parquet_file(path)
    index = 0
    for batch in table.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            body = {k: v for k, v in row.items() if k != "custom_id" and v is not None}
            yield BatchLine(index, row.get("custom_id", str(index)), "/v1/score", body)
            index += 1


def parquet_row_count(path: str) -> int:
    return _parquet_file(path).metadata.num_rows


def _parquet_file(path: str):
    import pyarrow.parquet  # the `batch` extra: only Parquet input needs it
    table = pyarrow.parquet.ParquetFile(path)
    missing = set(PARQUET_COLUMNS) - set(table.schema_arrow.names)
    if missing:
        raise ValueError(f"{path}: Parquet input needs the columns {', '.join(PARQUET_COLUMNS)}; "
                         f"it lacks {', '.join(sorted(missing))}")
    return table


def result_line(index: int, custom_id, status: int | None, body, error=None) -> bytes:
    response = None if status is None else {"status_code": status, "body": body}
    return (json.dumps({"id": f"batch_req_{index}", "custom_id": custom_id,
                        "response": response, "error": error}) + "\n").encode()


class ResultLog:
    """The output file, appended a whole line at a time: which input lines have a result."""

    def __init__(self, path: str):
        self.done = bytearray()  # done[i]: line i has its result
        self.written = 0         # results in the file, from earlier runs too
        kept = self._read(path)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.truncate(self._fd, kept)  # a last line cut short is not done
        os.lseek(self._fd, kept, os.SEEK_SET)

    def _read(self, path: str) -> int:
        """Marks the results already in `path`; the bytes up to its last whole line."""
        kept = 0
        if not os.path.exists(path):
            return kept
        with open(path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break
                self._mark(_result_index(raw, path))
                kept += len(raw)
        return kept

    def _mark(self, index: int) -> None:
        if index >= len(self.done):
            self.done.extend(bytes(max(index + 1, 2 * len(self.done)) - len(self.done)))
        self.done[index] = 1
        self.written += 1

    def has(self, index: int) -> bool:
        return index < len(self.done) and self.done[index] == 1

    def write(self, results: list[tuple[int, bytes]]) -> None:
        data = b"".join(line for _, line in results)
        while data:
            data = data[os.write(self._fd, data):]
        for index, _ in results:
            self._mark(index)

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        os.fsync(self._fd)
        os.close(self._fd)

    def __enter__(self) -> "ResultLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Result(NamedTuple):
    index: int      # the input line it answers
    line: bytes     # its result line
    items: int      # items it scored
    failed: bool


@dataclasses.dataclass
class Counts:
    requests: int = 0  # results written this run
    items: int = 0     # items and documents they scored
    failed: int = 0    # of them, error results


def run_job(lines: Iterable[BatchLine], log: ResultLog, routes_: dict[str, Route],
            max_in_flight: int, on_progress: Callable[[Counts], None] = lambda c: None,
            sync_every_s: float = 1.0) -> Counts:
    """Scores every line without a result in `log`, `max_in_flight` requests at a time,
    writing each result as it finishes; the file is synced to disk at most every
    `sync_every_s` (a process killed loses nothing written; a machine lost, that much)."""
    counts, in_flight = Counts(), {}
    pending = (line for line in lines if not log.has(line.index))
    exhausted, synced = False, time.monotonic()
    while not exhausted or in_flight:
        while not exhausted and len(in_flight) < max_in_flight:
            line = next(pending, None)
            if line is None:
                exhausted = True
                break
            done = _submit(line, routes_, in_flight)
            if done:
                _record(log, counts, [done])
        if in_flight:
            finished, _ = concurrent.futures.wait(
                list(in_flight), timeout=sync_every_s,
                return_when=concurrent.futures.FIRST_COMPLETED)
            _record(log, counts, [_answer(f, *in_flight.pop(f)) for f in finished])
        if time.monotonic() - synced >= sync_every_s:
            log.sync()
            synced = time.monotonic()
        on_progress(counts)
    return counts


def _submit(line: BatchLine, routes_: dict[str, Route], in_flight: dict) -> _Result | None:
    """Submits `line`'s request; its result now if it has no request to run."""
    if line.error is not None:
        error = {"code": "invalid_request", "message": line.error}
        return _Result(line.index, result_line(line.index, line.custom_id, None, None, error), 0,
                       True)
    route = routes_[line.url]
    try:
        request = route.parse(line.body)
        in_flight[route.submit(request)] = (line, route, request)
    except Exception as e:  # refused (a ScoreError), or a bug: this line's result only
        return _failed(line, e)
    return None


def _answer(future, line: BatchLine, route: Route, request) -> _Result:
    try:
        body = route.respond(request, future.result())
    except Exception as e:  # a failed request fails its own line only
        return _failed(line, e)
    items = route.items(request)
    return _Result(line.index, result_line(line.index, line.custom_id, 200, body), items, False)


def _failed(line: BatchLine, e: Exception) -> _Result:
    """What the HTTP route answers for the error `e`."""
    e = e if isinstance(e, ScoreError) else ScoreError(f"internal error: {e}", 500)
    body = error_body(e.message, e.status, e.type)
    return _Result(line.index, result_line(line.index, line.custom_id, e.status, body), 0, True)


def _record(log: ResultLog, counts: Counts, results: list[_Result]) -> None:
    log.write([(r.index, r.line) for r in results])
    for r in results:
        counts.requests += 1
        counts.items += r.items
        counts.failed += r.failed
