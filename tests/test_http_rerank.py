"""/v1/rerank over a real socket (Cohere's and Jina's body, SGLang's `instruct`), on tiny Qwen3
checkpoints whose tokenizers hold ChatML's specials, "yes" and "no": the built-in
qwen3-reranker template, scored against the model-card recipe computed independently."""
import concurrent.futures
import math

import pytest
import tokenizers

from runtime.engine import Engine
from runtime.rerank import BUILT_IN, QWEN3_RERANKER
from server.app import RERANK_ROUTES
from tests.assertions import assert_scores_close
from tests.numpy_decoder import NumpyDecoder
from tests.server_harness import OK, assert_error, call, metrics_lines, serving
from tests.tiny_models import small_config, write_checkpoint

QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of France is Paris.", "Tokyo is a city in Japan.", "",
             "héllo wörld, 世界 🙂", "The capital of France is Paris."]  # the last: a tie
LONG_CONTEXT = dict(max_position_embeddings=1024)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rerankers")
    return {"causal": write_checkpoint(str(root / "causal"), "qwen3", 7, **LONG_CONTEXT),
            **{f"classifier{n}": write_checkpoint(str(root / f"cls{n}"), "qwen3_cls", 8 + n,
                                                  num_labels=n, **LONG_CONTEXT)
               for n in (1, 2)}}


@pytest.fixture(scope="module")
def rerankers(checkpoints):
    engines = {name: Engine.from_path(path, small_config(max_prefill_tokens=512))
               for name, path in checkpoints.items()}
    yield engines
    for engine in engines.values():
        engine.close()


@pytest.fixture(scope="module")
def port(rerankers):
    with serving(rerankers["causal"]) as p:
        yield p


def rerank(port, body, path="/v1/rerank"):
    return call(port, "POST", path, body)[:2]


def card_recipe(model_dir: str, query: str, document: str) -> list[int]:
    """Qwen3-Reranker's model card, with the checkpoint's own tokenizer.json: prefix tokens,
    tokenizer(body), suffix tokens."""
    tok = tokenizers.Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    t = BUILT_IN[QWEN3_RERANKER]
    body = (f"<Instruct>: {t.default_instruct}\n<Query>: {query}\n<Document>: {document}")
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    return encode(t.prefix[0]) + tok.encode(body).ids + encode(t.suffix[0])


def test_response_is_cohere_shaped_and_scores_the_model_card_recipe(port, checkpoints):
    status, payload = rerank(port, {"query": QUERY, "documents": DOCUMENTS, "model": "m"})
    assert status == 200, payload
    assert set(payload) == {"id", "model", "results", "usage"}
    assert payload["id"].startswith("rerank-") and payload["model"] == "default"
    results = payload["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
    for r in results:
        assert set(r) == {"index", "relevance_score", "document"}
        assert r["document"] == {"text": DOCUMENTS[r["index"]]}
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
    numpy = NumpyDecoder(checkpoints["causal"])
    tok = tokenizers.Tokenizer.from_file(f"{checkpoints['causal']}/tokenizer.json")
    yes, no = tok.token_to_id("yes"), tok.token_to_id("no")
    for r in results:
        z = numpy.last_logits(card_recipe(checkpoints["causal"], QUERY, DOCUMENTS[r["index"]]))
        assert abs(r["relevance_score"] - 1 / (1 + math.exp(z[no] - z[yes]))) < 1e-3
    usage = payload["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 0


def test_scores_equal_each_prompt_scored_alone_through_v1_score(port, rerankers):
    reranker = rerankers["causal"].reranker
    _, payload = rerank(port, {"query": QUERY, "documents": DOCUMENTS})
    for r in payload["results"]:
        prompt = reranker.prompt(QUERY, DOCUMENTS[r["index"]])
        status, alone, _ = call(port, "POST", "/v1/score", {
            "query": prompt[:-1], "items": [prompt[-1:]], "apply_softmax": True,
            "label_token_ids": reranker.label_ids})
        assert status == 200
        assert_scores_close([alone["scores"][0][0]], [r["relevance_score"]])


def test_ties_keep_document_order_and_every_route_answers_alike(port):
    answers = [rerank(port, {"query": QUERY, "documents": DOCUMENTS}, path)
               for path in RERANK_ROUTES]
    rankings = [[(r["index"], r["relevance_score"]) for r in a[1]["results"]] for a in answers]
    assert all(a[0] == 200 for a in answers)
    for ranking in rankings[1:]:
        assert [k for k, _ in ranking] == [k for k, _ in rankings[0]]
        assert_scores_close([s for _, s in ranking], [s for _, s in rankings[0]])
    order = [k for k, _ in rankings[0]]
    assert order.index(0) < order.index(4)  # equal documents: scored once, the first first
    assert dict(rankings[0])[0] == dict(rankings[0])[4]


def test_top_n_objects_and_return_documents(port):
    _, full = rerank(port, {"query": QUERY, "documents": DOCUMENTS})
    _, top = rerank(port, {"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS],
                           "top_n": 2, "return_documents": False})
    assert [r["index"] for r in top["results"]] == [r["index"] for r in full["results"][:2]]
    assert all(set(r) == {"index", "relevance_score"} for r in top["results"])
    _, more = rerank(port, {"query": QUERY, "documents": DOCUMENTS[:2], "top_n": 10})
    assert len(more["results"]) == 2


def test_empty_documents_and_unicode(port):
    status, payload = rerank(port, {"query": "q", "documents": []})
    assert status == 200 and payload["results"] == []
    assert payload["usage"] == {"prompt_tokens": 0, "total_tokens": 0}
    status, payload = rerank(port, {"query": "世界 🙂 ?", "documents": ["wörld 🙂", "\u0000 \t"]})
    assert status == 200 and [r["document"]["text"] for r in payload["results"]] != []
    assert {r["document"]["text"] for r in payload["results"]} == {"wörld 🙂", "\u0000 \t"}


def test_instruct_is_the_prompts_instruction(port, rerankers):
    reranker = rerankers["causal"].reranker
    instruct = "Judge the documents about Japan"
    _, payload = rerank(port, {"query": QUERY, "documents": DOCUMENTS[:2],
                               "instruct": instruct})
    _, default = rerank(port, {"query": QUERY, "documents": DOCUMENTS[:2]})
    score = {r["index"]: r["relevance_score"] for r in payload["results"]}
    assert score != {r["index"]: r["relevance_score"] for r in default["results"]}
    prompt = reranker.prompt(QUERY, DOCUMENTS[1], instruct)
    _, alone, _ = call(port, "POST", "/v1/score", {
        "query": prompt[:-1], "items": [prompt[-1:]], "apply_softmax": True,
        "label_token_ids": reranker.label_ids})
    assert_scores_close([alone["scores"][0][0]], [score[1]])


def test_a_document_too_long_is_named_or_cut_on_request(port):
    documents = ["short", "Paris " * 600]
    status, payload = rerank(port, {"query": QUERY, "documents": documents})
    assert_error(status, payload, 400, "documents[1] makes a prompt of")
    status, payload = rerank(port, {"query": QUERY, "documents": documents,
                                    "max_tokens_per_doc": 20})
    assert status == 200 and len(payload["results"]) == 2
    assert {r["document"]["text"] for r in payload["results"]} == set(documents)


BAD_BODIES = [
    (b"{", "invalid JSON"),
    ([QUERY], "JSON object"),
    ({"documents": ["a"]}, "'query'"),
    ({"query": "q"}, "'documents'"),
    ({"query": 5, "documents": ["a"]}, "query must be a string"),
    ({"query": "q", "documents": "a"}, "documents must be a list"),
    ({"query": "q", "documents": ["a", 5]}, "documents[1] must be"),
    ({"query": "q", "documents": [{"txt": "a"}]}, "documents[0] must be"),
    ({"query": "q", "documents": [{"text": 1}]}, "documents[0] must be"),
    ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n must be an integer >= 1, got 0"),
    ({"query": "q", "documents": ["a"], "top_n": "2"}, "top_n must be"),
    ({"query": "q", "documents": ["a"], "top_n": True}, "top_n must be"),
    ({"query": "q", "documents": ["a"], "top_n": 1.5}, "top_n must be"),
    ({"query": "q", "documents": ["a"], "return_documents": "no"}, "return_documents must be"),
    ({"query": "q", "documents": ["a"], "instruct": 3}, "instruct must be a string"),
    ({"query": "q", "documents": ["a"], "max_tokens_per_doc": 0}, "max_tokens_per_doc must"),
    ({"query": "q", "documents": ["a"], "model": 3}, "model must be a string"),
]


@pytest.mark.parametrize("body, fragment", BAD_BODIES)
def test_bad_requests_get_400_naming_the_field(port, body, fragment):
    assert_error(*rerank(port, body), 400, fragment)


def test_only_post(port):
    status, payload, headers = call(port, "GET", "/v1/rerank")
    assert_error(status, payload, 405, "POST")
    assert headers["Allow"] == "POST"


def test_concurrent_with_score_traffic(port):
    """Rerank and score requests at once answer as they do alone, each counted."""
    _, alone = rerank(port, {"query": QUERY, "documents": DOCUMENTS})
    _, score_alone, _ = call(port, "POST", "/v1/score", OK)
    before = metrics_lines(port)

    def one(k):
        if k % 2:
            return rerank(port, {"query": QUERY, "documents": DOCUMENTS})
        return call(port, "POST", "/v1/score", OK)[:2]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(16)))
    for k, (status, payload) in enumerate(answers):
        assert status == 200, payload
        if k % 2:
            assert_scores_close([r["relevance_score"] for r in payload["results"]],
                                [r["relevance_score"] for r in alone["results"]])
        else:
            assert_scores_close(payload["scores"], score_alone["scores"])
    counted = lambda lines: next(int(line.rsplit(" ", 1)[1]) for line in lines  # noqa: E731
                                 if line.startswith('jax_score_http_requests_total{route='
                                                    '"/v1/rerank",status="200"}'))
    assert counted(metrics_lines(port)) - counted(before) == 8


@pytest.mark.parametrize("classes", [1, 2])
def test_a_classifier_reranks_by_its_last_class(rerankers, checkpoints, classes):
    """One class: sigmoid of its logit; two: the softmax's second."""
    engine = rerankers[f"classifier{classes}"]
    numpy = NumpyDecoder(checkpoints[f"classifier{classes}"])
    with serving(engine) as p:
        status, payload = rerank(p, {"query": QUERY, "documents": DOCUMENTS[:3]})
    assert status == 200, payload
    for r in payload["results"]:
        z = numpy.last_logits(card_recipe(checkpoints[f"classifier{classes}"], QUERY,
                                          DOCUMENTS[r["index"]]))
        want = 1 / (1 + math.exp(-z[0])) if classes == 1 else 1 / (1 + math.exp(z[0] - z[1]))
        assert abs(r["relevance_score"] - want) < 1e-4


def test_a_model_that_cannot_rerank_says_why(engines):
    with serving(engines["qwen3_cls"]) as p:  # three classes
        assert_error(*rerank(p, {"query": "q", "documents": ["a"]}), 501,
                     "reranking is off: a classifier of 3 classes cannot rerank")


def test_bench_rerank_times_new_and_repeated_queries(port):
    import asyncio

    from profiling.bench_rerank import bench
    result = asyncio.run(bench(f"http://127.0.0.1:{port}", [1, 3], doc_words=4, repeats=1,
                               seed=0))
    rows = result["rows"]
    assert [(r["documents"], r["query_cached"]) for r in rows] == [
        (1, False), (1, True), (3, False), (3, True)]
    assert all(r["documents_per_s"] > 0 and r["prompt_tokens_per_document"] > 4 for r in rows)
