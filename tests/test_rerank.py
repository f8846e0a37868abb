"""Rerank templates, the packing of a query's documents into multi-item prompts, and
`Engine.rerank`, on the embedded SmolLM2 (its ChatML tokenizer holds <|im_start|>, <|im_end|>,
yes and no)."""
import concurrent.futures
import dataclasses
import json
import math

import pytest
import tokenizers
from gguf import GGUFReader
from tokenizers import models

from model.config import ModelConfig
from model.gguf_loader import gguf_tokenizer
from model.loader import embedded_model_path
from model.tokenizer import TextTokenizer
from runtime.engine import Engine, _reranker, _then
from runtime.engine_config import EngineConfig
from runtime.errors import ScoreError
from runtime.rerank import (
    BUILT_IN,
    QWEN3_RERANKER,
    Reranker,
    RerankTemplate,
    load_template,
    ranking,
    relevance,
)
from tests.assertions import assert_scores_close

DOCUMENTS = ["The giant panda is a bear native to China.", "", " a leading space",
             "Paris", "Pandas eat bamboo. 熊猫吃竹子。", "a {query} and a {doc} in the text"]


@pytest.fixture(scope="module")
def tokenizer():
    return gguf_tokenizer(GGUFReader(embedded_model_path()))


@pytest.fixture(scope="module")
def qwen3(tokenizer):
    return Reranker(load_template(QWEN3_RERANKER), tokenizer)


def test_prompt_is_the_model_cards_recipe(qwen3, tokenizer):
    """Qwen3-Reranker's card: prefix + tokenizer(format_instruction(...)) + suffix."""
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on "
              "the Query and the Instruct provided. Note that the answer can only be \"yes\" or "
              "\"no\".<|im_end|>\n<|im_start|>user\n")
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    instruct = "Given a web search query, retrieve relevant passages that answer the query"
    body = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}".format(
        instruction=instruct, query="What is the capital of China?", doc="Beijing.")
    want = tokenizer.encode(prefix) + tokenizer.encode_with_specials(body) + tokenizer.encode(
        suffix)
    assert qwen3.prompt("What is the capital of China?", "Beijing.") == want
    assert qwen3.label_ids == [tokenizer.token_id("yes"), tokenizer.token_id("no")]
    assert tokenizer.decode(want[:1]) == "<|im_start|>"  # one special token, not its letters


@pytest.mark.parametrize("instruct", [None, "Find the documents about pandas"])
def test_packed_prompts_are_the_reference_tokens(qwen3, tokenizer, instruct):
    query = "what do pandas eat?"
    packed = qwen3.pack(query, DOCUMENTS, instruct)
    assert len(packed.items) == len(DOCUMENTS)
    for doc, item in zip(DOCUMENTS, packed.items):
        assert packed.query + item == qwen3.prompt(query, doc, instruct)
        assert item  # each document is an item of its own
    # the shared query is the prompt before the document: the same whatever the documents
    assert tokenizer.decode(packed.query).endswith("<Document>:")
    assert qwen3.pack(query, ["x"], instruct).query == packed.query


def test_fields_are_filled_in_one_pass(qwen3, tokenizer):
    """A query or document that holds a placeholder stays text."""
    text = tokenizer.decode(qwen3.prompt("q {doc} {instruct}", "d {query}"))
    assert "<Query>: q {doc} {instruct}\n<Document>: d {query}<|im_end|>" in text


def test_documents_cut_to_max_tokens_per_doc(qwen3, tokenizer):
    doc = "one two three four five six"
    packed = qwen3.pack("q", [doc, "short"], max_tokens_per_doc=3)
    assert packed.query + packed.items[0] == qwen3.prompt("q", "one two three")
    assert packed.query + packed.items[1] == qwen3.prompt("q", "short")


def test_no_documents_pack_to_nothing(qwen3):
    packed = qwen3.pack("q", [])
    assert packed.query == [] and packed.items == []


def test_labels_must_be_tokens_of_the_vocabulary(tokenizer):
    template = RerankTemplate("", "{query} {doc}", "", ("yes", "definitely-not-a-token"))
    with pytest.raises(ValueError, match="definitely-not-a-token"):
        Reranker(template, tokenizer)


def test_a_template_file_is_read_and_checked(tmp_path):
    fields = dict(prefix="P:", body="Q: {query} D: {doc}", suffix=" A:", labels=["yes", "no"])
    path = tmp_path / "t.json"
    path.write_text(json.dumps(fields))
    assert load_template(str(path)) == RerankTemplate("P:", "Q: {query} D: {doc}", " A:",
                                                      ("yes", "no"))
    assert load_template(QWEN3_RERANKER) is BUILT_IN[QWEN3_RERANKER]
    bad = [({**fields, "body": "Q: {query}"}, "{doc}"),
           ({**fields, "body": "{query} {doc} {doc}"}, "{doc}"),
           ({k: v for k, v in fields.items() if k != "suffix"}, "'suffix' is missing"),
           ({**fields, "labels": "yes"}, "'labels' must be a list"),
           ({**fields, "labels": ["yes"]}, "two label strings"),
           ({**fields, "prefix": 3}, "'prefix' must be a string"),
           ({**fields, "colour": "red"}, "JSON object of"),
           ([1, 2], "JSON object of")]
    for raw, message in bad:
        path.write_text(json.dumps(raw))
        with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("}", r"\}")):
            load_template(str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="t.json"):
        load_template(str(path))
    with pytest.raises(ValueError, match="neither a built-in template"):
        load_template(str(tmp_path / "missing.json"))


def test_ranking_is_by_relevance_then_index():
    assert ranking([0.2, 0.9, 0.2, 0.5], None) == [(1, 0.9), (3, 0.5), (0, 0.2), (2, 0.2)]
    assert ranking([0.2, 0.9, 0.2, 0.5], 2) == [(1, 0.9), (3, 0.5)]
    assert ranking([], 3) == []


def test_relevance_of_label_probabilities_and_classifier_logits():
    assert relevance([0.75, 0.25], is_classifier=False) == 0.75
    assert relevance([0.0], is_classifier=True) == 0.5
    assert relevance([math.log(3)], is_classifier=True) == pytest.approx(0.75)
    assert relevance([1.0, 1.0 + math.log(3)], is_classifier=True) == pytest.approx(0.75)


def test_the_default_template_is_off_where_the_vocabulary_lacks_its_labels(tokenizer):
    words = TextTokenizer(tokenizers.Tokenizer(models.WordLevel({"a": 0, "?": 1},
                                                                unk_token="?")))
    llama = ModelConfig("llama", 2, 8, 16, 1, 2, 1, 4, 1e4, 1e-5, 64)
    reranker, why = _reranker("", words, llama)
    assert reranker is None and "['yes', 'no'] are not tokens" in why
    with pytest.raises(ValueError, match="yes"):
        _reranker(QWEN3_RERANKER, words, llama)  # named: an error at start-up
    assert _reranker("", tokenizer, llama)[0].label_ids == [tokenizer.token_id("yes"),
                                                            tokenizer.token_id("no")]
    classifier = dataclasses.replace(llama, num_labels=1)
    assert _reranker("", words, classifier)[0].label_ids == []  # scored by its class
    three = dataclasses.replace(llama, num_labels=3)
    assert _reranker("", words, three) == (None, "a classifier of 3 classes cannot rerank "
                                                 "(one or two are needed)")
    with pytest.raises(ValueError, match="3 classes"):
        _reranker(QWEN3_RERANKER, words, three)


@pytest.fixture(scope="module")
def smollm():
    engine = Engine.from_path(None, EngineConfig(max_prefill_tokens=256, warmup=False))
    yield engine
    engine.close()


def test_rerank_scores_each_prompt_as_scoring_it_alone(smollm):
    query = "What do giant pandas eat?"
    documents = ["Giant pandas eat bamboo, almost nothing else.", "Paris is in France.", "",
                 "熊猫吃竹子。"]
    instruct = "Find what answers the question"
    result = smollm.rerank(query, documents, instruct=instruct)
    assert sorted(k for k, _ in result.ranking) == list(range(len(documents)))
    relevances = [r for _, r in result.ranking]
    assert relevances == sorted(relevances, reverse=True)
    yes_no = smollm.reranker.label_ids
    for k, r in result.ranking:
        prompt = smollm.reranker.prompt(query, documents[k], instruct)
        alone = smollm.score(prompt[:-1], [prompt[-1:]], yes_no, apply_softmax=True)
        assert_scores_close([alone.scores[0][0]], [r])
    top = smollm.rerank(query, documents, instruct, top_n=2).ranking  # the query now cached
    assert [k for k, _ in top] == [k for k, _ in result.ranking[:2]]
    assert_scores_close([r for _, r in top], relevances[:2])


def test_rerank_names_the_document_too_long_and_cuts_it_on_request(smollm):
    documents = ["short", "word " * 300]
    with pytest.raises(ScoreError, match=r"documents\[1\] makes a prompt of \d+ tokens"):
        smollm.rerank("q", documents)
    assert len(smollm.rerank("q", documents, max_tokens_per_doc=50).ranking) == 2
    assert smollm.rerank("q", []).ranking == []


def test_a_rerank_future_follows_its_score_future():
    """Its result is mapped, its failure passed on, and cancelling it drops the scoring."""
    source = concurrent.futures.Future()
    out = _then(source, lambda x: x + 1)
    source.set_result(1)
    assert out.result() == 2
    source = concurrent.futures.Future()
    out = _then(source, lambda x: x)
    source.set_exception(ScoreError("bad"))
    with pytest.raises(ScoreError, match="bad"):
        out.result()
    source = concurrent.futures.Future()
    _then(source, lambda x: x).cancel()
    assert source.cancelled()
