"""Scoring engine (SPEC §3-§4): tokenize, pack, prefill-only forwards, logits to scores."""
import dataclasses
import threading

import jax
import numpy as np

from kernels.attention_plan import BlockSizes, default_block_sizes
from model.config import ModelConfig
from model.decoder import ATTENTION_BACKENDS, empty_cache, score_forward
from model.loader import DTYPES, load_model
from model.tokenizer import TextTokenizer
from runtime.batch_builder import build_batch, pages_needed
from runtime.errors import ScoreError
from runtime.packing import Sequence, causal_sequence, item_chunks, multi_item_sequence
from runtime.pages import PageAllocator
from runtime.request import ScoreRequest, check_token_range, parse_score_request


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    dtype: str = "float32"
    page_size: int = 16
    max_batch_tokens: int = 8192  # new tokens in one forward
    max_seqs: int = 64            # sequences in one forward
    max_rows: int = 256           # scored rows in one forward
    attention_backend: str = "auto"  # "auto": the Pallas kernel on TPU, the reference elsewhere
    q_block: int = 0              # Pallas block sizes; 0: from the table for this device kind
    kv_block: int = 0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if (self.page_size <= 0 or self.max_batch_tokens < self.page_size
                or self.max_seqs <= 0 or self.max_rows <= 0):
            raise ValueError(f"invalid engine config {self}")
        if self.attention_backend not in ("auto",) + ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be auto or one of {ATTENTION_BACKENDS}")

    def backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "pallas" if jax.default_backend() == "tpu" else "reference"

    def block_sizes(self) -> BlockSizes | None:
        if self.backend() == "reference":
            return None
        default = default_block_sizes(jax.devices()[0].device_kind, self.page_size)
        sizes = BlockSizes(self.q_block or default.q_block, self.kv_block or default.kv_block)
        sizes.check(self.page_size)
        return sizes

    @property
    def num_pages(self) -> int:
        # Every sequence may waste up to one partial page.
        return pages_needed(self.max_batch_tokens, self.page_size) + self.max_seqs


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    scores: list[list[float]]
    prompt_tokens: int


@dataclasses.dataclass(frozen=True)
class _Forward:
    seqs: list[Sequence]
    items: list[int]  # item index of each scored row, in row order


class Engine:
    def __init__(self, cfg: ModelConfig, params: dict, tokenizer: TextTokenizer,
                 engine_cfg: EngineConfig = EngineConfig()):
        self.cfg, self.params, self.tokenizer, self.engine_cfg = cfg, params, tokenizer, engine_cfg
        self.pages = PageAllocator(engine_cfg.num_pages)
        self._cache = self._new_cache()
        self.backend, self.block_sizes = engine_cfg.backend(), engine_cfg.block_sizes()
        self._step = jax.jit(score_forward, donate_argnames=("cache",), static_argnames=(
            "cfg", "max_q_len", "with_logsumexp", "backend", "sizes"))
        self._lock = threading.Lock()

    @classmethod
    def from_path(cls, model_path: str | None, engine_cfg: EngineConfig = EngineConfig()):
        cfg, params, tokenizer = load_model(model_path, engine_cfg.dtype)
        return cls(cfg, params, tokenizer, engine_cfg)

    @property
    def max_prompt_tokens(self) -> int:
        return min(self.cfg.max_context, self.engine_cfg.max_batch_tokens)

    def score(self, query, items, label_token_ids=None, apply_softmax=False,
              item_first=False) -> ScoreResult:
        body = dict(query=query, items=items, label_token_ids=label_token_ids,
                    apply_softmax=apply_softmax, item_first=item_first)
        return self.score_request(parse_score_request(body, not self.cfg.is_classifier))

    def score_request(self, req: ScoreRequest) -> ScoreResult:
        labels = self._labels(req)
        query, items = self._tokenize(req)
        if not items:
            return ScoreResult([], 0)
        forwards = self._plan(req, query, items)
        logits = np.zeros((len(items), len(labels)))
        lse = np.zeros(len(items))
        with_lse = not req.apply_softmax and not self.cfg.is_classifier
        for fwd in forwards:
            fwd_logits, fwd_lse = self._run(fwd.seqs, labels, with_lse)
            logits[fwd.items], lse[fwd.items] = fwd_logits, fwd_lse
        used = sum(len(s.tokens) for f in forwards for s in f.seqs)
        return ScoreResult(self._scores(logits, lse, req.apply_softmax).tolist(), used)

    def _labels(self, req: ScoreRequest) -> list[int]:
        if self.cfg.is_classifier:
            return list(range(self.cfg.num_labels))
        check_token_range(req.label_token_ids, self.cfg.vocab_size, "label_token_ids")
        return list(req.label_token_ids)

    def _tokenize(self, req: ScoreRequest) -> tuple[list[int], list[list[int]]]:
        if not req.is_text:
            check_token_range(req.query, self.cfg.vocab_size, "query")
            for k, item in enumerate(req.items):
                check_token_range(item, self.cfg.vocab_size, f"items[{k}]")
            return list(req.query), [list(i) for i in req.items]
        return self.tokenizer.encode(req.query), [self.tokenizer.encode(i) for i in req.items]

    def _prompt_check(self, n: int, k: int) -> None:
        if n == 0:
            raise ScoreError(f"the prompt of items[{k}] is empty: nothing to score")
        if n > self.max_prompt_tokens:
            raise ScoreError(f"the prompt of items[{k}] has {n} tokens, more than the "
                             f"maximum of {self.max_prompt_tokens}")

    def _plan(self, req: ScoreRequest, query, items) -> list[_Forward]:
        prefix = self.tokenizer.prefix_ids if req.is_text else []
        if req.item_first:
            seqs = [causal_sequence(prefix + item + query) for item in items]
            for k, s in enumerate(seqs):
                self._prompt_check(len(s.tokens), k)
            return self._group(seqs, [[k] for k in range(len(items))])
        head = prefix + query
        for k, item in enumerate(items):
            self._prompt_check(len(head) + len(item), k)
        ec = self.engine_cfg
        chunks = item_chunks(len(head), [len(i) for i in items], ec.max_batch_tokens, ec.max_rows)
        seqs = [multi_item_sequence(head, [items[k] for k in c]) for c in chunks]
        return self._group(seqs, [list(c) for c in chunks])

    def _group(self, seqs: list[Sequence], items: list[list[int]]) -> list[_Forward]:
        """Packs sequences into forwards within the token and sequence budgets."""
        ec = self.engine_cfg
        forwards, cur, cur_items, used = [], [], [], 0
        for seq, its in zip(seqs, items):
            n = len(seq.tokens)
            if cur and (used + n > ec.max_batch_tokens or len(cur) == ec.max_seqs
                        or len(cur_items) + len(its) > ec.max_rows):
                forwards.append(_Forward(cur, cur_items))
                cur, cur_items, used = [], [], 0
            cur, cur_items, used = cur + [seq], cur_items + its, used + n
        forwards.append(_Forward(cur, cur_items))
        return forwards

    def _run(self, seqs: list[Sequence], labels: list[int], with_lse: bool):
        n_rows = sum(len(s.score_rows) for s in seqs)
        ec = self.engine_cfg
        with self._lock:
            tables = []
            try:
                for seq in seqs:
                    tables.append(self.pages.allocate(pages_needed(len(seq.tokens), ec.page_size)))
                batch, max_q_len = build_batch(seqs, tables, [labels] * n_rows, ec.page_size,
                                               self.pages.num_pages * ec.page_size,
                                               self.block_sizes)
                logits, lse, self._cache = self._step(
                    self.params, self._cache, batch, cfg=self.cfg, max_q_len=max_q_len,
                    with_logsumexp=with_lse, backend=self.backend, sizes=self.block_sizes)
                logits = np.asarray(logits, np.float64)[:n_rows, :len(labels)]
                lse = np.asarray(lse, np.float64)[:n_rows] if with_lse else np.zeros(n_rows)
            except BaseException:
                self._restore_cache()
                raise
            finally:
                for pages in tables:
                    self.pages.release(pages)
        return logits, lse

    def _new_cache(self):
        ec = self.engine_cfg
        return empty_cache(self.cfg, ec.num_pages, ec.page_size, DTYPES[ec.dtype])

    def _restore_cache(self) -> None:
        """A step that failed after taking the donated cache leaves it deleted: start a new one."""
        if self._cache.k.is_deleted() or self._cache.v.is_deleted():
            self._cache = self._new_cache()

    def _scores(self, logits: np.ndarray, lse: np.ndarray, apply_softmax: bool) -> np.ndarray:
        if apply_softmax:
            shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
            return shifted / shifted.sum(axis=1, keepdims=True)
        if self.cfg.is_classifier:
            return logits
        return np.exp(logits - lse[:, None])
