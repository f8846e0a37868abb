"""Rerank templates, the packing of a query's documents into multi-item prompts, and
`Engine.rerank`, on the embedded SmolLM2 (its ChatML tokenizer holds <|im_start|>, <|im_end|>,
yes and no)."""
import concurrent.futures
import dataclasses
import json
import math

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from model.config import ModelConfig
from model.gguf_file import read_gguf
from model.gguf_tokenizer import gguf_tokenizer
from model.loader import embedded_model_path
from model.tokenizer import TextTokenizer
from runtime.engine import Engine, _reranker, _then
from runtime.engine_config import EngineConfig
from runtime.errors import ScoreError
from runtime.rerank import (
    BGE_RERANKER_GEMMA,
    BUILT_IN,
    MXBAI_RERANK_V2,
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
    return gguf_tokenizer(read_gguf(embedded_model_path()))


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
           ({**fields, "labels": ["yes"]}, "needs 2 label strings"),
           ({**fields, "score": "logit", "labels": ["a", "b", "c"]}, "1 or 2 label strings"),
           ({**fields, "score": "probit"}, "score is one of"),
           ({**fields, "body": ["Q: {query} D: {do", "c}"]}, "split across"),
           ({**fields, "body_specials": "no"}, "true or false"),
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
    assert relevance([2.5], False, "logit") == 2.5  # one label's raw logit
    assert relevance([2.5, 4.0], False, "logit") == -1.5  # the difference of two
    assert relevance([math.log(3)], False, "sigmoid") == pytest.approx(0.75)
    assert relevance([1.0, 1.0 - math.log(3)], False, "logit", normalize=True) == (
        pytest.approx(0.75))
    assert relevance([0.75, 0.25], False, "softmax", normalize=True) == 0.75
    assert relevance([-1000.0], False, "sigmoid") == 0.0  # no overflow
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


def gemma_like_tokenizer() -> TextTokenizer:
    """A byte-level BPE with Gemma's <bos> put before a text, and "Yes" one token."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<eos>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["Yes", "No", "A: what is a panda?", "B: a bear"] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    return TextTokenizer(tok)


@pytest.mark.parametrize("instruct", [None, "Find the answer"])
def test_bge_reranker_gemma_prompt_is_its_model_cards_tokens(instruct):
    """BAAI/bge-reranker-v2-gemma's get_inputs: [bos] + tok("A: " + query) + tok("\\n") +
    tok("B: " + passage) + tok("\\n") + tok(prompt), each without special tokens; scored by
    the logit of "Yes" (there is no instruct: one given changes nothing)."""
    tok = gemma_like_tokenizer()
    bge = Reranker(load_template(BGE_RERANKER_GEMMA), tok)
    prompt = ("Given a query A and a passage B, determine whether the passage contains an answer "
              "to the query by providing a prediction of either 'Yes' or 'No'.")
    query = "what is panda?"
    for passage in DOCUMENTS:
        want = ([tok.token_id("<bos>")] + tok.encode(f"A: {query}") + tok.encode("\n")
                + tok.encode(f"B: {passage}") + tok.encode("\n") + tok.encode(prompt))
        assert bge.prompt(query, passage, instruct) == want
    packed = bge.pack(query, DOCUMENTS, instruct)
    assert [packed.query + item for item in packed.items] == [
        bge.prompt(query, d) for d in DOCUMENTS]
    assert bge.label_ids == [tok.token_id("Yes")] == tok.encode("Yes")[:1]
    assert bge.template.score == "logit"


@pytest.mark.parametrize("instruct", [None, "Find the answer"])
def test_mxbai_rerank_v2_prompt_is_its_codes_tokens(tokenizer, instruct):
    """mixedbread-ai's MxbaiRerankV2.prepare_inputs: tok(chat prefix) + tok(query prompt, with
    "instruction: ...\\n" before it where given) + tok("\\n") + tok("document: " + doc) +
    tok("\\n") + tok(task prompt) + tok(chat suffix), each without special tokens; scored by
    logit("1") - logit("0")."""
    mxbai = Reranker(load_template(MXBAI_RERANK_V2), tokenizer)
    prefix = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
              "assistant.<|im_end|>\n<|im_start|>user\n")
    task = ("You are a search relevance expert who evaluates how well documents match search "
            "queries. For each query-document pair, carefully analyze the semantic relationship "
            "between them, then provide your binary relevance judgment (0 for not relevant, 1 "
            "for relevant).\nRelevance:")
    suffix = "<|im_end|>\n<|im_start|>assistant\n"
    query = "what is panda?"
    query_prompt = f"query: {query}"
    if instruct:
        query_prompt = "".join([f"instruction: {instruct}", "\n", query_prompt])
    for doc in DOCUMENTS:
        want = (tokenizer.encode(prefix) + tokenizer.encode(query_prompt)
                + tokenizer.encode("\n") + tokenizer.encode(f"document: {doc}")
                + tokenizer.encode("\n") + tokenizer.encode(task) + tokenizer.encode(suffix))
        assert mxbai.prompt(query, doc, instruct) == want
    packed = mxbai.pack(query, DOCUMENTS, instruct)
    assert [packed.query + item for item in packed.items] == [
        mxbai.prompt(query, d, instruct) for d in DOCUMENTS]
    assert mxbai.label_ids == [tokenizer.token_id("1"), tokenizer.token_id("0")]


def test_a_raw_logit_template_ranks_by_the_labels_logits(smollm):
    """mxbai's form on the embedded model (it has "1" and "0"): a document's relevance is
    logit("1") - logit("0") of its prompt scored alone, its sigmoid with `normalize`."""
    engine = Engine.from_path(None, EngineConfig(max_prefill_tokens=256, warmup=False,
                                                 rerank_template=MXBAI_RERANK_V2))
    try:
        query, documents = "What do giant pandas eat?", ["Bamboo.", "Paris is in France."]
        raw = dict(engine.rerank(query, documents).ranking)
        body = {"query": query, "documents": documents, "normalize": True}
        from runtime.request import parse_rerank_request
        normalized = dict(engine.submit_rerank(parse_rerank_request(body)).result().ranking)
        ones_zeros = engine.reranker.label_ids
        for k, doc in enumerate(documents):
            prompt = engine.reranker.prompt(query, doc)
            p1, p0 = smollm.score(prompt[:-1], [prompt[-1:]], ones_zeros).scores[0]
            assert raw[k] == pytest.approx(math.log(p1) - math.log(p0), abs=1e-4)
            assert normalized[k] == pytest.approx(1 / (1 + math.exp(-raw[k])), abs=1e-9)
    finally:
        engine.close()
