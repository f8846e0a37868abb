"""Does int8 (W8A8, `--quantization int8`) keep the ranking? The same scoring set scored by a
model in float32, in bfloat16 and in int8, compared query by query: int8 against the 16-bit
model (the targets), and bfloat16 against float32 beside it, what 16 bits' own rounding moves.

python -m profiling.int8_ranking [--model_path DIR|FILE.gguf] [--queries 200] [--items 20]
    [--dtype float32] [--rerank_template qwen3-reranker] [--out ranking.json]

The scoring set is made here, from word lists of this file (ours to ship): each query asks for
a kind of thing for a purpose ("a kitchen tool for baking bread"), its items name things of
several kinds with an adjective, and the score is SGLang's: the probability of " yes" against
" no" after "Is this a good match? Answer yes or no:". Per query: Spearman's correlation of
the item scores and whether the top item agrees; over all: the mean and worst correlation, the
top-1 agreement and the largest probability difference. Targets (issue 75), int8 against
bfloat16: mean Spearman >= 0.98, top-1 agreement >= 95%. With --rerank_template, the same
queries and items go through /v1/rerank's path instead (`Engine.rerank`, that template:
"a kitchen tool for baking bread" against "a sturdy whisk"), the score each document's
relevance.
"""
import time

import numpy as np
from absl import app, flags

from profiling.timing import write_json
from runtime.cli_flags import parse_flags
from runtime.engine import Engine
from runtime.engine_config import EngineConfig

FLAGS = flags.FLAGS
KINDS = {
    "kitchen tool": ["whisk", "rolling pin", "chef's knife", "cast iron pan", "ladle",
                     "food processor", "baking sheet", "peeler"],
    "garden tool": ["spade", "rake", "pruning shears", "watering can", "wheelbarrow", "hoe",
                    "hose", "trowel"],
    "book": ["mystery novel", "cookbook", "atlas", "poetry collection", "biography",
             "field guide", "textbook", "comic book"],
    "piece of clothing": ["raincoat", "wool sweater", "linen shirt", "hiking boots",
                          "sun hat", "scarf", "swimsuit", "gloves"],
    "toy": ["puzzle", "kite", "building blocks", "teddy bear", "toy train", "yo-yo",
            "board game", "jump rope"],
    "piece of furniture": ["bookshelf", "armchair", "desk", "bunk bed", "coffee table",
                           "wardrobe", "bar stool", "sofa"],
}
PURPOSES = ["baking bread", "a rainy day", "a long hike", "a child's birthday", "a small flat",
            "learning at school", "a summer holiday", "cold winter nights", "a dinner party",
            "working from home"]
ADJECTIVES = ["sturdy", "cheap", "lightweight", "classic", "colorful", "large", "compact",
              "handmade", "old", "modern"]
PROMPT = "Query: I am looking for a {kind} for {purpose}.\nItem:"
SUFFIX = "\nIs this a good match? Answer yes or no:"


def define_flags() -> None:
    flags.DEFINE_string("model_path", None, "checkpoint directory or .gguf; default: the "
                        "embedded SmolLM2-135M-Instruct")
    flags.DEFINE_integer("queries", 200, "queries in the scoring set")
    flags.DEFINE_integer("items", 20, "items a query")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "what the int8 model "
                      "computes in besides its int8 dots")
    flags.DEFINE_integer("seed", 0, "seed of the scoring set")
    flags.DEFINE_string("rerank_template", "", "score by reranking with this template (a "
                        "built-in name, e.g. qwen3-reranker) instead of SGLang's yes/no score")
    flags.DEFINE_string("out", None, "write the results as JSON here")


def scoring_set(queries: int, items: int, seed: int) -> list[tuple[str, list[str]]]:
    rng = np.random.default_rng(seed)
    things = [(kind, thing) for kind, names in KINDS.items() for thing in names]
    out = []
    for _ in range(queries):
        kind = list(KINDS)[rng.integers(len(KINDS))]
        query = PROMPT.format(kind=kind, purpose=PURPOSES[rng.integers(len(PURPOSES))])
        picks = rng.choice(len(things), items, replace=False)
        out.append((query, [f" a {ADJECTIVES[rng.integers(len(ADJECTIVES))]} "
                            f"{things[i][1]}{SUFFIX}" for i in picks]))
    return out


def spearman(a, b) -> float:
    ra, rb = (np.argsort(np.argsort(x)).astype(np.float64) for x in (a, b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra @ rb) / np.sqrt((ra @ ra) * (rb @ rb)))


def labels(engine: Engine) -> list[int]:
    ids = [engine.tokenizer.encode(word) for word in (" yes", " no")]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"' yes' and ' no' are not one token each here: {ids}")
    return [i[0] for i in ids]


def scores(engine: Engine, cases) -> tuple[np.ndarray, float]:
    """P(yes) of every item [queries, items], and the seconds it took."""
    ids = labels(engine)
    start = time.perf_counter()
    out = [engine.score(query, items, ids, apply_softmax=True).scores for query, items in cases]
    return np.array(out)[:, :, 0], time.perf_counter() - start


def rerank_case(query: str, items: list[str]) -> tuple[str, list[str]]:
    """A scoring case as a rerank request: "a kitchen tool for baking bread" and its items'
    names ("a sturdy whisk")."""
    return (query.removeprefix("Query: I am looking for ").removesuffix(".\nItem:"),
            [item.removesuffix(SUFFIX).strip() for item in items])


def relevances(engine: Engine, cases) -> tuple[np.ndarray, float]:
    """Each item's relevance [queries, items] by `Engine.rerank`, in the items' order, and the
    seconds it took."""
    start = time.perf_counter()
    out = []
    for query, items in cases:
        by_index = dict(engine.rerank(*rerank_case(query, items)).ranking)
        out.append([by_index[i] for i in range(len(items))])
    return np.array(out), time.perf_counter() - start


def compare(base: np.ndarray, int8: np.ndarray) -> dict:
    rho = np.array([spearman(a, b) for a, b in zip(base, int8)])
    top1 = np.mean(np.argmax(base, axis=1) == np.argmax(int8, axis=1))
    return {"mean_spearman": float(rho.mean()), "min_spearman": float(rho.min()),
            "top1_agreement": float(top1), "max_probability_difference":
            float(np.abs(base - int8).max()), "targets_met": bool(rho.mean() >= 0.98
                                                                  and top1 >= 0.95)}


PAIRS = (("bfloat16", "float32"), ("int8", "bfloat16"), ("int8", "float32"))


def main(argv) -> None:
    del argv
    cases = scoring_set(FLAGS.queries, FLAGS.items, FLAGS.seed)
    runs = {}
    for name, dtype, quantization in (("float32", "float32", ""), ("bfloat16", "bfloat16", ""),
                                      ("int8", FLAGS.dtype, "int8")):
        engine = Engine.from_path(FLAGS.model_path, EngineConfig(
            dtype=dtype, quantization=quantization, warmup=False,
            rerank_template=FLAGS.rerank_template))
        runs[name] = (relevances if FLAGS.rerank_template else scores)(engine, cases)
        engine.close()
    pairs = {f"{a} against {b}": compare(runs[b][0], runs[a][0]) for a, b in PAIRS}
    result = {"queries": FLAGS.queries, "items": FLAGS.items, "model_path": FLAGS.model_path,
              "rerank_template": FLAGS.rerank_template, "int8_dtype": FLAGS.dtype,
              "pairs": pairs,
              "seconds": {name: run[1] for name, run in runs.items()}}
    scored = (f"reranked ({FLAGS.rerank_template})" if FLAGS.rerank_template
              else "scored (P(yes))")
    print(f"{FLAGS.queries} queries x {FLAGS.items} items {scored}, int8 in {FLAGS.dtype} "
          "besides its dots; targets: int8 against bfloat16, mean Spearman >= 0.98, top-1 >= "
          "95%")
    print("| pair | mean Spearman | worst | top-1 agreement | largest score difference |")
    print("|---|---|---|---|---|")
    for name, r in pairs.items():
        print(f"| {name} | {r['mean_spearman']:.4f} | {r['min_spearman']:.4f} | "
              f"{r['top1_agreement']:.1%} | {r['max_probability_difference']:.4f} |")
    met = pairs["int8 against bfloat16"]["targets_met"]
    print(f"targets {'met' if met else 'missed'}; seconds: " + ", ".join(
        f"{name} {run[1]:.1f}" for name, run in runs.items()))
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
