"""Request bodies from JSON and answers to it: msgspec's codec where it is installed (the
`processes` extra, which `make install` brings: a body of token ids read in a third of the
standard library's time, an answer written in a tenth), the standard library's otherwise. A
body msgspec refuses is read again by the standard library, whose values and error messages
hold either way; msgspec's answers are the same values, compact and in UTF-8."""
import json

from runtime.errors import ScoreError

try:
    import msgspec
except ImportError:  # plain `pip install .`: the standard library's codec
    msgspec = None


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
