"""One scoring request in the runtime: its work units and its result, filled as units finish."""
import concurrent.futures
import dataclasses
import itertools

import numpy as np

from runtime.errors import ScoreError
from runtime.packing import Sequence


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    scores: list[list[float]]
    prompt_tokens: int  # tokens of the sequences scored (cached or computed)


SCORE_KINDS = ("label_softmax", "logits", "vocab_probs")


def label_scores(logits: np.ndarray, lse: np.ndarray, kind: str) -> np.ndarray:
    """CONTRACT §3: softmax over the labels, raw logits (a classifier's; a rerank template's
    that scores by them), or full-vocabulary probabilities."""
    if kind == "label_softmax":
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)
    if kind == "logits":
        return logits
    return np.exp(logits - lse[:, None])


def forward_scores(logits: np.ndarray, lse: np.ndarray, units: list[tuple[str, int, int]]
                   ) -> list[np.ndarray]:
    """label_scores of each unit's rows of a forward: `units`, each one's (kind, labels, rows)
    in the forward's row order. Consecutive units alike are computed in one call: a row's
    scores are its own row's alone (the same numbers), and a call costs some 14 µs of NumPy
    overhead for a request's 10 rows as for a forward's hundreds."""
    out, row = [], 0
    for (kind, labels), alike in itertools.groupby(units, key=lambda u: u[:2]):
        sizes = [n for _, _, n in alike]
        stop = row + sum(sizes)
        scores = label_scores(np.ascontiguousarray(logits[row:stop, :labels]), lse[row:stop],
                              kind)
        out += [scores[at:at + n] for at, n in zip(itertools.accumulate(sizes, initial=0), sizes)]
        row = stop
    return out


@dataclasses.dataclass(eq=False)
class Job:
    """Answered when its `n_units` units are done; only `unit_done` and `fail` change it."""
    labels: list[int]
    n_items: int
    n_units: int
    kind: str  # of SCORE_KINDS
    future: concurrent.futures.Future = dataclasses.field(
        default_factory=concurrent.futures.Future)

    def __post_init__(self):
        if self.kind not in SCORE_KINDS:
            raise ValueError(f"a job's scores are one of {SCORE_KINDS}, not {self.kind!r}")
        self.scores = np.zeros((self.n_items, len(self.labels)))
        self._pending, self._prompt_tokens = self.n_units, 0
        if self.n_units == 0:  # nothing to score
            self._answer()

    @property
    def with_lse(self) -> bool:
        return self.kind == "vocab_probs"

    @property
    def active(self) -> bool:
        """False once cancelled, failed or answered: its remaining units are dropped."""
        return not self.future.done()

    def unit_done(self, items: range, scores: np.ndarray, prompt_tokens: int) -> None:
        """`scores`: the unit's items' label_scores (forward_scores)."""
        self.scores[items.start:items.stop] = scores  # a unit's items are consecutive
        self._pending, self._prompt_tokens = self._pending - 1, self._prompt_tokens + prompt_tokens
        if self._pending == 0:
            self._answer()

    def _answer(self) -> None:
        result = ScoreResult(self.scores.tolist(), self._prompt_tokens)
        self._settle(lambda f: f.set_result(result))

    def fail(self, error: ScoreError) -> None:
        self._settle(lambda f: f.set_exception(error))

    def _settle(self, how) -> None:
        try:
            how(self.future)
        except concurrent.futures.InvalidStateError:
            pass  # cancelled meanwhile: nobody waits for it


@dataclasses.dataclass(eq=False)
class Unit:
    """One sequence of a job, scoring `items` (its rows, in order)."""
    job: Job
    seq: Sequence
    items: range
