"""Validation of a /v1/score (CONTRACT §2) or /v1/rerank request body into a typed request."""
import dataclasses
import json

from runtime.errors import ScoreError

Tokens = list[int]


@dataclasses.dataclass(frozen=True)
class ScoreRequest:
    query: str | Tokens
    items: list[str] | list[Tokens]
    label_token_ids: Tokens
    apply_softmax: bool = False
    item_first: bool = False
    model: str = "default"
    raw_logits: bool = False  # the labels' logits themselves (a rerank template's); not HTTP's

    @property
    def is_text(self) -> bool:
        return isinstance(self.query, str)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_list(value, what: str) -> Tokens:
    if not isinstance(value, list) or not set(map(type, value)) <= {int}:  # bool is not int
        raise ScoreError(f"{what} must be a string or a list of integer token ids")
    return value


def _items(raw) -> list:
    if isinstance(raw, str):
        return [raw]
    if not isinstance(raw, list):
        raise ScoreError("items must be a string, a list of strings or a list of token-id lists")
    if all(isinstance(x, str) for x in raw):
        return raw
    if all(isinstance(x, list) for x in raw):
        return [_token_list(x, f"items[{i}]") for i, x in enumerate(raw)]
    raise ScoreError("items must be all strings or all token-id lists")


def _flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ScoreError(f"{name} must be a boolean")
    return value


def parse_score_request(body, needs_labels: bool = True) -> ScoreRequest:
    if not isinstance(body, dict):
        raise ScoreError("request body must be a JSON object")
    for field in ("query", "items"):
        if body.get(field) is None:
            raise ScoreError(f"missing required field '{field}'")
    query = body["query"]
    if not isinstance(query, str):
        query = _token_list(query, "query")
    labels = body.get("label_token_ids")
    return checked_score_request(
        query, _items(body["items"]),
        None if labels is None else _token_list(labels, "label_token_ids"),
        _flag(body, "apply_softmax"), _flag(body, "item_first"), _model(body), needs_labels)


def checked_score_request(query: str | Tokens, items: list, labels: Tokens | None,
                          apply_softmax: bool, item_first: bool, model: str,
                          needs_labels: bool = True) -> ScoreRequest:
    """The request of fields of the right types (a text or a token-id list each, items all
    of one kind; `labels` None where the body has none), checked together."""
    if items and isinstance(items[0], str) != isinstance(query, str):
        raise ScoreError("query and items must both be text or both be token ids")
    if labels is None:
        if needs_labels:
            raise ScoreError("missing required field 'label_token_ids'")
        labels = []
    if needs_labels and not labels:
        raise ScoreError("label_token_ids must not be empty")
    return ScoreRequest(query, items, labels, apply_softmax, item_first, model)


@dataclasses.dataclass(frozen=True)
class RerankRequest:
    query: str
    documents: list[str]
    top_n: int | None = None             # keep the most relevant top_n; None: all
    return_documents: bool = True
    instruct: str | None = None          # None: the rerank template's default
    max_tokens_per_doc: int | None = None
    model: str = "default"
    normalize: bool = False              # a raw-logit template's score as its sigmoid


def parse_rerank_request(body) -> RerankRequest:
    """Cohere's and Jina's rerank body (documents as strings or {"text": ...}), with SGLang's
    `instruct`."""
    if not isinstance(body, dict):
        raise ScoreError("request body must be a JSON object")
    for field in ("query", "documents"):
        if body.get(field) is None:
            raise ScoreError(f"missing required field '{field}'")
    if not isinstance(body["query"], str):
        raise ScoreError("query must be a string")
    if not isinstance(body["documents"], list):
        raise ScoreError("documents must be a list of strings or of {\"text\": string} objects")
    instruct = body.get("instruct")
    if instruct is not None and not isinstance(instruct, str):
        raise ScoreError("instruct must be a string")
    return RerankRequest(body["query"], [_document(d, k) for k, d in enumerate(body["documents"])],
                         _count(body, "top_n"), _flag(body, "return_documents", True), instruct,
                         _count(body, "max_tokens_per_doc"), _model(body),
                         _flag(body, "normalize", False))


def _document(doc, k: int) -> str:
    text = doc.get("text") if isinstance(doc, dict) else doc
    if not isinstance(text, str):
        raise ScoreError(f"documents[{k}] must be a string or an object with a string 'text'")
    return text


def _count(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and not (_is_int(value) and value >= 1):
        raise ScoreError(f"{name} must be an integer >= 1, got {json.dumps(value)[:40]}")
    return value


def _model(body: dict) -> str:
    model = body.get("model", "default")
    if not isinstance(model, str):
        raise ScoreError("model must be a string")
    return model


def check_token_ranges(lists: list[Tokens], vocab_size: int, name) -> None:
    """Raises ScoreError naming the first id outside [0, vocab_size); `name(k)` names
    lists[k]. All in range (the common case) is one min and one max over every id: under
    half the time of a pass a list."""
    filled = [ids for ids in lists if ids]
    if not filled or (min(map(min, filled)) >= 0 and max(map(max, filled)) < vocab_size):
        return
    for k, ids in enumerate(lists):
        token = next((t for t in ids if not 0 <= t < vocab_size), None)
        if token is not None:
            raise ScoreError(f"{name(k)} contains token id {token}, outside the vocabulary "
                             f"[0, {vocab_size})")
