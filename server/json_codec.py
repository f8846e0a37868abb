"""Request bodies from JSON and answers to it: msgspec's codec where it is installed (the
`processes` extra, which `make install` brings: a body of token ids read in a third of the
standard library's time, an answer written in a tenth; a score body read and typed in one
pass), the standard library's otherwise. A body msgspec refuses is read again by the standard
library, whose values and error messages hold either way; msgspec's answers are the same
values, compact and in UTF-8."""
import json

from runtime.errors import ScoreError
from runtime.request import ScoreRequest, checked_score_request, parse_score_request

try:
    import msgspec
except ImportError:  # plain `pip install .`: the standard library's codec
    msgspec = None
else:
    class _ScoreBody(msgspec.Struct):
        """A /v1/score body as msgspec checks it in C (JSON's true is not an int, 1.0 not
        one either); any other body is read by the standard library's path."""
        query: str | list[int]
        items: str | list[str | list[int]]
        label_token_ids: list[int] | None = None
        apply_softmax: bool = False
        item_first: bool = False
        model: str = "default"

    _SCORE_BODY = msgspec.json.Decoder(_ScoreBody)


def parse_json(body: bytes):
    """The body's JSON value; invalid JSON (NaN and Infinity included) raises ScoreError."""
    if msgspec is not None:
        try:
            return msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError):
            pass  # the standard library's verdict, and its message
    try:
        return json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise ScoreError("request body is not valid UTF-8") from None
    except RecursionError:
        raise ScoreError("request body is nested too deeply") from None
    except ValueError as e:
        raise ScoreError(f"invalid JSON body: {e}") from None


def to_json(value) -> bytes:
    if msgspec is not None:
        return msgspec.json.encode(value)
    return json.dumps(value).encode()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_score_body(body: bytes, needs_labels: bool = True) -> ScoreRequest:
    """A /v1/score body's request: read and typed by msgspec in one pass where it is installed
    (a body of token ids in under half the time of JSON and then Python's checks); a body it
    refuses, or without it, read by parse_json and runtime.request.parse_score_request, whose
    messages hold either way."""
    fields = None if msgspec is None else _typed_score_fields(body)
    if fields is None:
        return parse_score_request(parse_json(body), needs_labels)
    return checked_score_request(*fields, needs_labels)


def _typed_score_fields(body: bytes) -> tuple | None:
    """(query, items, labels, apply_softmax, item_first, model) of a well-formed score body;
    None for any other."""
    try:
        typed = _SCORE_BODY.decode(body)
    except (msgspec.DecodeError, RecursionError):  # a ValidationError is a DecodeError
        return None
    items = [typed.items] if isinstance(typed.items, str) else typed.items
    if len({type(item) for item in items}) > 1:
        return None  # texts and token lists mixed: the checks name it
    return (typed.query, items, typed.label_token_ids, typed.apply_softmax, typed.item_first,
            typed.model)
