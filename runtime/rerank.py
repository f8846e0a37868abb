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
BGE_RERANKER_GEMMA = "bge-reranker-v2-gemma"
MXBAI_RERANK_V2 = "mxbai-rerank-v2"
_FIELDS = re.compile(r"\{(instruct|query)\}")
SCORES = ("softmax", "logit", "sigmoid")


@dataclasses.dataclass(frozen=True)
class RerankTemplate:
    """The prompt is prefix + body + suffix, each a text or a list of texts tokenized one by
    one (as a model card's code may); the body holds `{query}` and `{doc}` once each (and
    `{instruct}` at most once). `labels`: the tokens whose logits make the score, the relevant
    one first; `score`: "softmax", the relevant label's probability over the two; "logit", its
    raw logit (one label) or the two logits' difference (two); "sigmoid", that logit's
    sigmoid (of a difference: the same as "softmax"). `body_specials`: the body's texts take
    what the tokenizer's post-processor adds (HF's `tokenizer(text)`, as Qwen3-Reranker's
    card); `instruct_text`: what `{instruct}` becomes when there is an instruct."""
    prefix: str | tuple[str, ...]
    body: str | tuple[str, ...]
    suffix: str | tuple[str, ...]
    labels: tuple[str, ...]
    default_instruct: str = ""
    score: str = "softmax"
    body_specials: bool = True
    instruct_text: str = "{instruct}"

    def __post_init__(self):
        for name in ("prefix", "body", "suffix"):
            value = getattr(self, name)
            pieces = (value,) if isinstance(value, str) else tuple(value)
            if not pieces or not all(isinstance(p, str) for p in pieces):
                raise ValueError(f"a rerank template's {name} is a text or a list of texts, "
                                 f"got {value!r}")
            object.__setattr__(self, name, pieces)
        text = "".join(self.body)
        for name in ("query", "doc"):
            if text.count("{" + name + "}") != 1:
                raise ValueError(f"a rerank template's body needs {{{name}}} exactly once: "
                                 f"{self.body!r}")
        if text.count("{instruct}") > 1:
            raise ValueError(f"a rerank template's body has {{instruct}} more than once: "
                             f"{self.body!r}")
        if not any("{doc}" in piece for piece in self.body):
            raise ValueError(f"{{doc}} is split across the body's texts: {self.body!r}")
        if self.score not in SCORES:
            raise ValueError(f"a rerank template's score is one of {SCORES}, got {self.score!r}")
        wanted = (2,) if self.score == "softmax" else (1, 2)
        if len(self.labels) not in wanted or not all(isinstance(s, str) and s
                                                     for s in self.labels):
            raise ValueError(f"a rerank template scored by {self.score} needs "
                             f"{' or '.join(map(str, wanted))} label strings, got {self.labels!r}")

    def body_pieces(self, query: str, instruct: str | None) -> "BodyPieces":
        """The body's texts filled in but for the document. One pass over the template: a
        query holding "{doc}" stays text."""
        instruct = self.default_instruct if instruct is None else instruct
        values = {"query": query,
                  "instruct": self.instruct_text.replace("{instruct}", instruct) if instruct
                  else ""}
        fill = lambda part: _FIELDS.sub(lambda m: values[m.group(1)], part)  # noqa: E731
        at = next(i for i, piece in enumerate(self.body) if "{doc}" in piece)
        before, after = self.body[at].split("{doc}")
        return BodyPieces([fill(p) for p in self.body[:at]], fill(before), fill(after),
                          [fill(p) for p in self.body[at + 1:]])


@dataclasses.dataclass(frozen=True)
class BodyPieces:
    leading: list[str]   # the body's texts before the document's
    before: str          # the document's text before the document, and after it
    after: str
    trailing: list[str]  # the body's texts after the document's


BUILT_IN = {QWEN3_RERANKER: RerankTemplate(  # Qwen3-Reranker's model card
    prefix="<|im_start|>system\nJudge whether the Document meets the requirements based on the "
           "Query and the Instruct provided. Note that the answer can only be \"yes\" or "
           "\"no\".<|im_end|>\n<|im_start|>user\n",
    body="<Instruct>: {instruct}\n<Query>: {query}\n<Document>: {doc}",
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    labels=("yes", "no"),
    default_instruct="Given a web search query, retrieve relevant passages that answer the "
                     "query"),
    BGE_RERANKER_GEMMA: RerankTemplate(  # BAAI/bge-reranker-v2-gemma's model card
        prefix="<bos>", body=("A: {query}", "\n", "B: {doc}"),
        suffix=("\n", "Given a query A and a passage B, determine whether the passage contains "
                "an answer to the query by providing a prediction of either 'Yes' or 'No'."),
        labels=("Yes",), score="logit", body_specials=False),
    MXBAI_RERANK_V2: RerankTemplate(  # mixedbread-ai's mxbai-rerank v2 (base, large) code
        prefix="<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
               "assistant.<|im_end|>\n<|im_start|>user\n",
        body=("{instruct}query: {query}", "\n", "document: {doc}"),
        suffix=("\n", "You are a search relevance expert who evaluates how well documents "
                "match search queries. For each query-document pair, carefully analyze the "
                "semantic relationship between them, then provide your binary relevance "
                "judgment (0 for not relevant, 1 for relevant).\nRelevance:",
                "<|im_end|>\n<|im_start|>assistant\n"),
        labels=("1", "0"), score="logit", body_specials=False,
        instruct_text="instruction: {instruct}\n"),
}


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
        kinds = _FIELD_KINDS.get(name, (str,))
        if not isinstance(raw.get(name, field.default), kinds):
            raise ValueError(f"rerank template {name_or_path}: {name!r} must be "
                             f"{_KIND_WORDS[kinds]}")
    try:
        return RerankTemplate(**{**raw, "labels": tuple(raw["labels"])})
    except ValueError as e:
        raise ValueError(f"rerank template {name_or_path}: {e}") from None


_FIELD_KINDS = {"labels": (list,), "body_specials": (bool,), "prefix": (str, list),
                "body": (str, list), "suffix": (str, list)}  # the rest: (str,)
_KIND_WORDS = {(list,): "a list of label strings", (bool,): "true or false",
               (str, list): "a string or a list of strings", (str,): "a string"}


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
        self._prefix, self._suffix = (self._pieces(getattr(template, part), tokenizer.encode)
                                      for part in ("prefix", "suffix"))
        self._encode_body = (tokenizer.encode_with_specials if template.body_specials
                             else tokenizer.encode)

    @staticmethod
    def _pieces(texts, encode) -> list[int]:
        return [i for text in texts for i in encode(text)]

    def prompt(self, query: str, document: str, instruct: str | None = None) -> list[int]:
        """The reference: the model card's tokens, prefix + its body's texts tokenized (each
        alone) + suffix."""
        return self._prompt(self.template.body_pieces(query, instruct), document)

    def _prompt(self, body: BodyPieces, document: str) -> list[int]:
        return (self._prefix + self._pieces(body.leading, self._encode_body)
                + self._encode_body(body.before + document + body.after)
                + self._pieces(body.trailing, self._encode_body) + self._suffix)

    def pack(self, query: str, documents: list[str], instruct: str | None = None,
             max_tokens_per_doc: int | None = None) -> PackedDocuments:
        """The documents' prompts as one multi-item query and an item each: query + item is
        exactly `prompt` of the document (cut to `max_tokens_per_doc` tokens)."""
        if max_tokens_per_doc is not None:
            documents = [self.tokenizer.decode(ids[:max_tokens_per_doc])
                         for ids in self.tokenizer.encode_pieces(documents)]
        if not documents:
            return PackedDocuments([], [])
        body = self.template.body_pieces(query, instruct)
        # `_prompt` of each document, the texts around it tokenized once and the documents'
        # in one call
        head = self._prefix + self._pieces(body.leading, self._encode_body)
        tail = self._pieces(body.trailing, self._encode_body) + self._suffix
        prompts = [head + ids + tail for ids in self.tokenizer.encode_pieces(
            [body.before + d + body.after for d in documents], self.template.body_specials)]
        # The prompt before the document, less its last token, which the document may merge
        # with (": " + "The" is ":", " The"): the same query whatever the documents.
        shared = len(head) + len(self._encode_body(body.before)) - 1
        shared = min([shared] + [_common_length(prompts[0], p) for p in prompts])
        return PackedDocuments(prompts[0][:shared], [p[shared:] for p in prompts])


def _common_length(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def relevance(scores: list[float], is_classifier: bool, score: str = "softmax",
              normalize: bool = False) -> float:
    """A document's relevance from its label scores: a causal LM's by the template's `score`
    (scores are the labels' softmax for "softmax", their raw logits otherwise; `normalize`: a
    raw logit's sigmoid, as "sigmoid"), or from a classifier's logits, sigmoid of one class or
    the softmax's last of two."""
    if is_classifier:
        return _sigmoid(scores[0] if len(scores) == 1 else scores[1] - scores[0])
    if score == "softmax":
        return scores[0]
    logit = scores[0] if len(scores) == 1 else scores[0] - scores[1]
    return _sigmoid(logit) if score == "sigmoid" or normalize else logit


def _sigmoid(x: float) -> float:
    return 0.5 * (1 + math.tanh(x / 2))  # no overflow at large |x|


def ranking(relevances: list[float], top_n: int | None) -> list[tuple[int, float]]:
    """Most relevant first, ties by index; the first `top_n`."""
    order = sorted(range(len(relevances)), key=lambda k: (-relevances[k], k))
    return [(k, relevances[k]) for k in order[:top_n]]
