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
