"""msgspec's JSON codec and the standard library's give the server the same values and the
same errors."""
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.errors import ScoreError
from server import json_codec

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30)

ODD_BODIES = [b'{"query": NaN}', b"[Infinity]", b"[1e400]", b'"\\ud800"', b'\xef\xbb\xbf{"a": 1}',
              b'{"a": 1} x', b"", b"\xff", b'"\xff"', b"[" * 100_000 + b"]" * 100_000,
              b'{"a": 1, "a": 2}', b"[123456789012345678901234567890, -0, 1.0]"]


def _standard_library(monkeypatch):
    monkeypatch.setattr(json_codec, "msgspec", None)


def _outcome(body: bytes):
    try:
        return "value", json_codec.parse_json(body)
    except ScoreError as e:
        return "error", e.message


def test_msgspec_is_what_the_server_runs_here():
    assert json_codec.msgspec is not None  # installed by `make install`: the fast path is tested


@pytest.mark.parametrize("body", ODD_BODIES, ids=range(len(ODD_BODIES)))
def test_odd_bodies_read_as_the_standard_library_reads_them(body, monkeypatch):
    fast = _outcome(body)
    _standard_library(monkeypatch)
    assert fast == _outcome(body)


@settings(max_examples=200, deadline=None)
@given(JSON_VALUES)
def test_values_read_and_written_the_same_either_way(value):
    body = json.dumps(value).encode()
    assert json_codec.parse_json(body) == value
    assert json.loads(json_codec.to_json(value)) == value
    with pytest.MonkeyPatch.context() as patch:
        _standard_library(patch)
        assert json_codec.parse_json(body) == value
        assert json.loads(json_codec.to_json(value)) == value


def test_answers_keep_every_bit_of_a_score_and_every_character():
    scores = [math.nextafter(0.5, 1), 1 / 3, 5e-324, 0.1 + 0.2]
    answer = {"scores": scores, "document": {"text": "naïve café 検索 \U0001f600"}}
    assert json.loads(json_codec.to_json(answer)) == answer


TOKENS = st.lists(st.integers(-3, 10**20), max_size=4)
ODD_TOKENS = st.lists(st.integers(0, 9) | st.booleans() | st.just(1.5), min_size=1, max_size=4)
ITEMS = st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3) | st.lists(TOKENS,
                                                                                 max_size=3)
SCORE_BODIES = st.fixed_dictionaries(
    {"query": st.text(max_size=5) | TOKENS, "items": ITEMS},
    optional={"label_token_ids": TOKENS, "apply_softmax": st.booleans(),
              "item_first": st.booleans(), "model": st.text(max_size=5), "extra": JSON_VALUES})
ODD_VALUES = (JSON_VALUES | ODD_TOKENS | st.integers(0, 1)
              | st.lists(st.text(max_size=2) | TOKENS | ODD_TOKENS, min_size=1, max_size=3))
# a well-formed body, or one with a field made odd (or taken out)
ODD_SCORE_BODIES = st.tuples(SCORE_BODIES, st.sampled_from(
    ["query", "items", "label_token_ids", "apply_softmax", "item_first", "model"]),
    ODD_VALUES | st.just(...)).map(
    lambda t: {k: v for k, v in {**t[0], t[1]: t[2]}.items() if v is not ...})


def _score_outcome(body: bytes, needs_labels: bool):
    try:
        return "request", json_codec.parse_score_body(body, needs_labels)
    except ScoreError as e:
        return "error", e.message


def _assert_read_alike(fields: dict, needs_labels: bool) -> None:
    """msgspec's typed reading of the body gives the request, or the error, that JSON and then
    runtime.request's checks give."""
    body = json.dumps(fields).encode()
    fast = _score_outcome(body, needs_labels)
    with pytest.MonkeyPatch.context() as patch:
        _standard_library(patch)
        assert fast == _score_outcome(body, needs_labels)


SCORE_CASES = [
    {"query": "q", "items": ["a", [1]], "label_token_ids": [1]},
    {"query": [1], "items": [[2], "a"], "label_token_ids": [1]},
    {"query": [1, True], "items": [[2]], "label_token_ids": [1]},
    {"query": [1], "items": [[2, 1.0]], "label_token_ids": [1]},
    {"query": [1], "items": [[2]], "label_token_ids": [False]},
    {"query": [1], "items": [[2]], "label_token_ids": [1], "apply_softmax": 1},
    {"query": [1], "items": [[2]], "label_token_ids": [1], "item_first": None},
    {"query": [1], "items": [[2]], "label_token_ids": [1], "model": None},
    {"query": None, "items": [[2]], "label_token_ids": [1]},
    {"query": [1], "items": [[[2]]], "label_token_ids": [1]},
    {"query": [10**30], "items": [[-1]], "label_token_ids": [10**30]},
    {"query": "q", "items": "a", "label_token_ids": None},
    {"query": "q", "items": [], "label_token_ids": []},
    {"query": [], "items": [[]], "label_token_ids": [1], "unknown": [1.5]},
]


@pytest.mark.parametrize("needs_labels", [True, False])
@pytest.mark.parametrize("fields", SCORE_CASES, ids=range(len(SCORE_CASES)))
def test_odd_score_bodies_read_as_the_standard_library_and_checks_read_them(fields,
                                                                           needs_labels):
    _assert_read_alike(fields, needs_labels)


@settings(max_examples=500, deadline=None)
@given(SCORE_BODIES | ODD_SCORE_BODIES, st.booleans())
def test_score_bodies_read_as_the_standard_library_and_checks_read_them(fields, needs_labels):
    """Well-formed bodies, and bodies with a field made odd: bools, floats, nulls and mixed
    items included."""
    _assert_read_alike(fields, needs_labels)


def test_a_well_formed_score_body_is_read_by_msgspec_alone(monkeypatch):
    def refused(*_):
        raise AssertionError("the standard library's path ran")
    monkeypatch.setattr(json_codec, "parse_score_request", refused)
    monkeypatch.setattr(json_codec, "parse_json", refused)
    body = {"query": [1, 2], "items": [[3], [4, 5]], "label_token_ids": [6],
            "apply_softmax": True}
    req = json_codec.parse_score_body(json.dumps(body).encode())
    assert (req.query, req.items, req.label_token_ids, req.apply_softmax) == (
        [1, 2], [[3], [4, 5]], [6], True)
    text = json_codec.parse_score_body(b'{"query": "q", "items": "one", "label_token_ids": [1]}')
    assert (text.query, text.items) == ("q", ["one"])
