"""One scoring request in the runtime: its work units and its result, filled as units finish."""
import concurrent.futures
import dataclasses

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
        self.logits = np.zeros((self.n_items, len(self.labels)))
        self.lse = np.zeros(self.n_items)
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

    def unit_done(self, items: range, logits: np.ndarray, lse: np.ndarray,
                  prompt_tokens: int) -> None:
        rows = slice(items.start, items.stop)  # a unit's items are consecutive
        self.logits[rows], self.lse[rows] = logits[:, :len(self.labels)], lse
        self._pending, self._prompt_tokens = self._pending - 1, self._prompt_tokens + prompt_tokens
        if self._pending == 0:
            self._answer()

    def _answer(self) -> None:
        scores = label_scores(self.logits, self.lse, self.kind)
        self._settle(lambda f: f.set_result(ScoreResult(scores.tolist(), self._prompt_tokens)))

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
