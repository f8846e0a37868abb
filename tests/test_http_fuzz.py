"""Property-based fuzz of the server: any JSON body and any bytes on the socket get well-formed
HTTP answers with a 2xx or 4xx status, and the server keeps serving.

The suite runs 300 examples of each; the long run (docs/correctness.md, "Fuzzing") sets
JAX_SCORE_FUZZ_EXAMPLES=10000 and --hypothesis-show-statistics, which lists the statuses seen."""
import json
import math
import os
import re
import socket

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from server.app import ServerConfig
from server.http import Limits
from tests.server_harness import OK, call, serving

FUZZ = settings(max_examples=int(os.environ.get("JAX_SCORE_FUZZ_EXAMPLES", "300")),
                deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
token_ids = st.lists(st.integers(-3, 330), max_size=12)
score_like = st.fixed_dictionaries({}, optional={
    "query": st.text(max_size=30) | token_ids | json_values,
    "items": st.lists(st.text(max_size=10), max_size=5) | st.lists(token_ids, max_size=5)
    | st.text(max_size=10) | json_values,
    "label_token_ids": token_ids | json_values,
    "apply_softmax": st.booleans() | json_values,
    "item_first": st.booleans() | json_values,
    "model": st.text(max_size=10) | json_values})

in_vocab = st.lists(st.integers(0, 319), max_size=8)
query_and_items = (
    st.fixed_dictionaries({"query": st.text(max_size=30),
                           "items": st.lists(st.text(max_size=10), max_size=5)})
    | st.fixed_dictionaries({"query": in_vocab, "items": st.lists(in_vocab, max_size=5)}))
labels_and_flags = st.fixed_dictionaries(
    {"label_token_ids": st.lists(st.integers(0, 319), min_size=1, max_size=4)},
    optional={"apply_softmax": st.booleans(), "item_first": st.booleans()})
plausible = st.builds(lambda a, b: {**a, **b}, query_and_items, labels_and_flags)

TEMPLATES = [
    b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/score HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (
        len(json.dumps(OK)), json.dumps(OK).encode()),
    b"POST /v1/score HTTP/1.1\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n"
    b"4\r\n{\"qu\r\n0\r\n\r\n",
    b"GET /metrics HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
]


@st.composite
def mutated_requests(draw) -> bytes:
    data = bytearray(draw(st.sampled_from(TEMPLATES)))
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["insert", "delete", "replace", "repeat"]))
        if op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=12)
                               | st.sampled_from([b"\r\n", b":", b" ", b"\x00", b"\xff"]))
        elif op == "delete":
            del data[at:at + draw(st.integers(1, 8))]
        elif op == "replace" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        else:
            data += data[at:]
    return bytes(data)


raw_inputs = st.binary(min_size=1, max_size=300) | mutated_requests()

STATUS_LINE = re.compile(rb"HTTP/1\.1 (\d{3}) [A-Za-z -]+")


def parse_responses(data: bytes) -> list[int]:
    """The statuses of a well-formed sequence of responses; raises if it is not one."""
    statuses = []
    while data:
        head, sep, data = data.partition(b"\r\n\r\n")
        assert sep, f"unterminated head {head[:200]!r}"
        lines = head.split(b"\r\n")
        match = STATUS_LINE.fullmatch(lines[0])
        assert match, f"bad status line {lines[0][:100]!r}"
        status = int(match.group(1))
        statuses.append(status)
        if status == 100:
            continue
        headers = dict(line.split(b": ", 1) for line in lines[1:])
        length = int(headers[b"Content-Length"])
        body, data = data[:length], data[length:]
        assert len(body) == length, "body shorter than its Content-Length"
        if headers[b"Content-Type"] == b"application/json":
            payload = json.loads(body)
            assert status == 200 or payload["object"] == "error", payload
    return statuses


def assert_answered(statuses: list[int]) -> None:
    """2xx, 4xx, 100 Continue, or 501 (RFC 9112 6.1) for a well-formed transfer coding other
    than chunked."""
    assert all(s in (100, 501) or 200 <= s < 300 or 400 <= s < 500 for s in statuses), statuses


@pytest.fixture(scope="module")
def port(engines):
    limits = Limits(max_body_bytes=1 << 14, header_timeout_s=5, body_timeout_s=5)
    with serving(engines["llama"], ServerConfig(limits=limits)) as p:
        yield p


@FUZZ
@given(body=plausible | score_like | json_values)
def test_any_json_body_gets_a_score_or_a_4xx(port, body):
    status, payload, _ = call(port, "POST", "/v1/score", json.dumps(body).encode())
    assert_answered([status])
    event(f"status {status}")
    if status == 200:
        items = body["items"] if isinstance(body["items"], list) else [body["items"]]
        scores = payload["scores"]
        assert len(scores) == len(items)
        assert all(len(row) == len(body["label_token_ids"]) for row in scores)
        assert all(0 <= p <= 1 and math.isfinite(p) for row in scores for p in row)
    else:
        assert payload["object"] == "error" and payload["code"] == status
    assert call(port, "GET", "/health")[0] == 200


@FUZZ
@given(data=raw_inputs)
def test_any_bytes_get_well_formed_4xx_answers(port, data):
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)  # the end of input: the server answers what it has
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    statuses = parse_responses(answer)
    assert_answered(statuses)
    event(f"statuses {sorted(set(statuses))}")
    assert statuses or not data.strip(b"\r\n"), data  # only empty lines go unanswered
    assert call(port, "GET", "/health")[0] == 200
