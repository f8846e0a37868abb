"""Reranking on multi-item scoring: a template turns (instruct, query, document) into the prompt
a causal-LM reranker was trained on; everything the documents share is the multi-item query and
each document (with the rest of the prompt) an item, so that a request is one pass and its
tokens are exactly those of the reference prompt, document by document."""
import dataclasses
import json
import math
import os
import re

from model.tokenizer import TextTokenizer

QWEN3_RERANKER = "qwen3-reranker"
_FIELDS = re.compile(r"\{(instruct|query)\}")


@dataclasses.dataclass(frozen=True)
class RerankTemplate:
    """The prompt is prefix + body + suffix, the body holding `{query}` and `{doc}` once each
    (and `{instruct}` at most once); `labels` are the tokens whose logits are compared, the
    relevant one first."""
    prefix: str
    body: str
    suffix: str
    labels: tuple[str, str]
    default_instruct: str = ""

    def __post_init__(self):
        for name in ("query", "doc"):
            if self.body.count("{" + name + "}") != 1:
                raise ValueError(f"a rerank template's body needs {{{name}}} exactly once: "
                                 f"{self.body!r}")
        if self.body.count("{instruct}") > 1:
            raise ValueError(f"a rerank template's body has {{instruct}} more than once: "
                             f"{self.body!r}")
        if len(self.labels) != 2 or not all(isinstance(s, str) and s for s in self.labels):
            raise ValueError(f"a rerank template needs two label strings, got {self.labels!r}")

    def around_document(self, query: str, instruct: str | None) -> tuple[str, str]:
        """The body's text before and after the document. One pass over the template: a
        query holding "{doc}" stays text."""
        values = {"query": query, "instruct": self.default_instruct if instruct is None
                  else instruct}
        before, after = self.body.split("{doc}")
        fill = lambda part: _FIELDS.sub(lambda m: values[m.group(1)], part)  # noqa: E731
        return fill(before), fill(after)


BUILT_IN = {QWEN3_RERANKER: RerankTemplate(  # Qwen3-Reranker's model card
    prefix="<|im_start|>system\nJudge whether the Document meets the requirements based on the "
           "Query and the Instruct provided. Note that the answer can only be \"yes\" or "
           "\"no\".<|im_end|>\n<|im_start|>user\n",
    body="<Instruct>: {instruct}\n<Query>: {query}\n<Document>: {doc}",
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    labels=("yes", "no"),
    default_instruct="Given a web search query, retrieve relevant passages that answer the "
                     "query")}


def load_template(name_or_path: str) -> RerankTemplate:
    """A built-in template by name, or a JSON file of the template's fields."""
    if name_or_path in BUILT_IN:
        return BUILT_IN[name_or_path]
    if not os.path.isfile(name_or_path):
        raise ValueError(f"--rerank-template {name_or_path!r} is neither a built-in template "
                         f"({', '.join(BUILT_IN)}) nor a file")
    try:
        with open(name_or_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"rerank template {name_or_path}: {e}") from None
    fields = {f.name: f for f in dataclasses.fields(RerankTemplate)}
    if not isinstance(raw, dict) or set(raw) - set(fields):
        raise ValueError(f"rerank template {name_or_path}: a JSON object of {sorted(fields)} "
                         f"expected")
    for name, field in fields.items():
        if name not in raw and field.default is dataclasses.MISSING:
            raise ValueError(f"rerank template {name_or_path}: {name!r} is missing")
        kind = list if name == "labels" else str
        if not isinstance(raw.get(name, kind()), kind):
            raise ValueError(f"rerank template {name_or_path}: {name!r} must be a "
                             f"{'list of two strings' if kind is list else 'string'}")
    return RerankTemplate(**{**raw, "labels": tuple(raw["labels"])})


@dataclasses.dataclass(frozen=True)
class PackedDocuments:
    query: list[int]        # the prefix and the body's tokens every document's prompt starts with
    items: list[list[int]]  # per document: the rest of its prompt


@dataclasses.dataclass(frozen=True)
class RerankResult:
    ranking: list[tuple[int, float]]  # (document index, relevance), most relevant first
    prompt_tokens: int


class Reranker:
    """A template bound to a tokenizer: its label ids, found once (a label that is not one
    token of the vocabulary is an error naming it; a classifier scores by its classes and
    needs none), and prompts packed for multi-item scoring."""

    def __init__(self, template: RerankTemplate, tokenizer: TextTokenizer,
                 with_labels: bool = True):
        self.template, self.tokenizer = template, tokenizer
        ids = [tokenizer.token_id(label) for label in template.labels] if with_labels else []
        missing = [label for label, i in zip(template.labels, ids) if i is None]
        if missing:
            raise ValueError(f"rerank labels {missing} are not tokens of the model's vocabulary")
        self.label_ids = ids
        self._prefix, self._suffix = tokenizer.encode(template.prefix), tokenizer.encode(
            template.suffix)

    def prompt(self, query: str, document: str, instruct: str | None = None) -> list[int]:
        """The reference: the model card's tokens, prefix + tokenizer(body) + suffix."""
        return self._prompt(*self.template.around_document(query, instruct), document)

    def _prompt(self, before: str, after: str, document: str) -> list[int]:
        body = self.tokenizer.encode_with_specials(before + document + after)
        return self._prefix + body + self._suffix

    def pack(self, query: str, documents: list[str], instruct: str | None = None,
             max_tokens_per_doc: int | None = None) -> PackedDocuments:
        """The documents' prompts as one multi-item query and an item each: query + item is
        exactly `prompt` of the document (cut to `max_tokens_per_doc` tokens)."""
        if max_tokens_per_doc is not None:
            documents = [self.tokenizer.decode(self.tokenizer.encode(d)[:max_tokens_per_doc])
                         for d in documents]
        if not documents:
            return PackedDocuments([], [])
        before, after = self.template.around_document(query, instruct)
        prompts = [self._prompt(before, after, d) for d in documents]
        # The prompt before the document, less its last token, which the document may merge
        # with (": " + "The" is ":", " The"): the same query whatever the documents.
        shared = len(self._prefix) + len(self.tokenizer.encode_with_specials(before)) - 1
        shared = min([shared] + [_common_length(prompts[0], p) for p in prompts])
        return PackedDocuments(prompts[0][:shared], [p[shared:] for p in prompts])


def _common_length(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def relevance(scores: list[float], is_classifier: bool) -> float:
    """A document's relevance from its label scores: the relevant label's probability (scores
    softmaxed over the two labels), or from a classifier's logits, sigmoid of one class or the
    softmax's last of two."""
    if not is_classifier:
        return scores[0]
    if len(scores) == 1:
        return 1 / (1 + math.exp(-scores[0]))
    return 1 / (1 + math.exp(scores[0] - scores[1]))


def ranking(relevances: list[float], top_n: int | None) -> list[tuple[int, float]]:
    """Most relevant first, ties by index; the first `top_n`."""
    order = sorted(range(len(relevances)), key=lambda k: (-relevances[k], k))
    return [(k, relevances[k]) for k in order[:top_n]]
