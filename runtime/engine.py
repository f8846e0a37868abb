"""Scoring engine (CONTRACT §3-§5): validate, tokenize and pack a request into units of work for
a replica's scheduler, which batches them with other requests' units on its devices."""
import concurrent.futures
import dataclasses
import hashlib

import jax
from absl import logging

from model.config import ModelConfig
from model.loader import load_model
from model.tokenizer import TextTokenizer
from runtime.distributed import StepChannel, follow
from runtime.engine_config import EngineConfig
from runtime.errors import ScoreError
from runtime.job import Job, ScoreResult, Unit
from runtime.model_runner import ModelRunner
from runtime.packing import Sequence, causal_sequence, item_chunks, multi_item_sequence
from runtime.replicas import local_replicas
from runtime.request import (
    RerankRequest,
    ScoreRequest,
    check_token_ranges,
    parse_rerank_request,
    parse_score_request,
)
from runtime.rerank import (
    QWEN3_RERANKER,
    Reranker,
    RerankResult,
    load_template,
    ranking,
    relevance,
)
from runtime.router import Router
from runtime.scheduler import Scheduler
from runtime.token_cache import TokenCache


class Engine:
    def __init__(self, cfg: ModelConfig, tokenizer: TextTokenizer, engine_cfg: EngineConfig,
                 replicas: list, channel: StepChannel | None = None):
        """`replicas`: one a device group, each a Scheduler in this process or a
        ReplicaProcess (runtime.replica_process); `channel`: multi-host node 0's, or a
        follower's, step channel. Made by `local` or `from_path`."""
        self.cfg, self.tokenizer, self.engine_cfg = cfg, tokenizer, engine_cfg
        self.token_cache = TokenCache(tokenizer)  # score requests' queries and items
        self.reranker, self.rerank_off = _reranker(engine_cfg.rerank_template, tokenizer, cfg)
        self.schedulers, self.channel = replicas, channel
        self.router = Router(self.schedulers, slack_tokens=engine_cfg.max_prefill_tokens)

    @classmethod
    def local(cls, cfg: ModelConfig, params: dict, tokenizer: TextTokenizer,
              engine_cfg: EngineConfig = EngineConfig(), runner_type=ModelRunner) -> "Engine":
        """The replicas in this process, one a device group; `params` on the host; each
        runner made by `runner_type` as a ModelRunner is made (a benchmark's simulated chips:
        profiling.simulated_chip)."""
        if engine_cfg.dtype == "auto":  # the params' own
            engine_cfg = dataclasses.replace(
                engine_cfg, dtype=jax.tree.leaves(params)[0].dtype.name)
        engine_cfg = dataclasses.replace(engine_cfg, replica_processes=False)
        multihost = jax.process_count() > 1
        if multihost and engine_cfg.dp_size > 1:
            raise ValueError("--dp-size > 1 across hosts is not supported: run one server per "
                             "host group behind a load balancer")
        groups = engine_cfg.device_groups(jax.devices())
        channel = StepChannel(engine_cfg.buckets(cfg, groups[0][0])) if multihost else None
        publish = channel.publish if channel and jax.process_index() == 0 else None
        replicas = local_replicas(cfg, params, engine_cfg, groups, runner_type, publish)
        return cls(cfg, tokenizer, engine_cfg, replicas, channel)

    @property
    def scheduler(self) -> Scheduler:
        """The first replica's (the only one unless dp_size > 1)."""
        return self.schedulers[0]

    @property
    def runner(self) -> ModelRunner:
        return self.schedulers[0].runner

    def statuses(self):
        """Each replica's ReplicaStatus (runtime.scheduler)."""
        return [replica.status() for replica in self.schedulers]

    def describe(self) -> str:
        """One line for the start-up log: model, dtype, kernels, devices, KV pool, policy."""
        first, ec = self.statuses()[0], self.engine_cfg
        where = " in processes of their own" if ec.replica_processes else ""
        return (f"{self.cfg.family} in {ec.dtype}, {first.backend} kernels, {ec.dp_size} "
                f"replica(s){where} of {ec.tp_size} {first.platform} device(s) "
                f"({first.device_kind}), KV pool of {first.kv_pages * first.page_size} tokens "
                f"a replica, {ec.schedule_policy} scheduling")

    @classmethod
    def from_path(cls, model_path: str | None, engine_cfg: EngineConfig = EngineConfig(),
                  runner_type=ModelRunner):
        """With engine_cfg.replica_processes, the replicas in engine processes of their own
        (this process touches no device); else in this one."""
        if engine_cfg.replica_processes:
            try:  # the processes extra's libraries
                from runtime.replica_process import start_replica_processes
            except ImportError as e:
                raise ValueError(f"replicas in processes of their own (--dp-size > 1) need "
                                 f"{e.name}: pip install 'jax-score[processes]'") from e
            cfg, tokenizer, engine_cfg, replicas = start_replica_processes(
                model_path, engine_cfg, runner_type)
            return cls(cfg, tokenizer, engine_cfg, replicas)
        engine_cfg = engine_cfg.resolve_dtype(model_path, jax.devices()[0].platform)
        cfg, params, tokenizer = load_model(model_path, engine_cfg.dtype,
                                            engine_cfg.quantization)
        return cls.local(cfg, params, tokenizer, engine_cfg, runner_type)

    def close(self) -> None:
        for scheduler in self.schedulers:
            scheduler.close()
        if self.channel and jax.process_index() == 0:
            self.channel.stop()
            self.channel = None  # the other nodes are gone: close only once

    def follow(self) -> int:
        """Multi-host nodes other than 0: run node 0's forwards until it closes."""
        return follow(self.runner, self.channel)

    def flush_prefix_cache(self) -> int:
        """Drops every cached prefix nobody is using; returns the pages freed."""
        return sum(s.flush_prefix_cache() for s in self.schedulers)

    def check_pages(self) -> None:
        for scheduler in self.schedulers:
            scheduler.check_pages()

    @property
    def max_prompt_tokens(self) -> int:
        return self.engine_cfg.max_prompt_tokens(self.cfg)

    def score(self, query, items, label_token_ids=None, apply_softmax=False,
              item_first=False) -> ScoreResult:
        body = dict(query=query, items=items, label_token_ids=label_token_ids,
                    apply_softmax=apply_softmax, item_first=item_first)
        return self.score_request(parse_score_request(body, not self.cfg.is_classifier))

    def rerank(self, query: str, documents: list[str], instruct: str | None = None,
               top_n: int | None = None, max_tokens_per_doc: int | None = None) -> RerankResult:
        body = dict(query=query, documents=documents, instruct=instruct, top_n=top_n,
                    max_tokens_per_doc=max_tokens_per_doc)
        return self.submit_rerank(parse_rerank_request(body)).result()

    def submit_rerank(self, req: RerankRequest) -> concurrent.futures.Future:
        """Queues the documents as one multi-item request of the rerank template's prompts
        (runtime.rerank); its future gives a RerankResult, most relevant first. Cancelling it
        drops the waiting work. Bad requests raise here."""
        if self.reranker is None:
            raise ScoreError(f"reranking is off: {self.rerank_off}", status=501)
        packed = self.reranker.pack(req.query, req.documents, req.instruct,
                                    req.max_tokens_per_doc)
        for k, item in enumerate(packed.items):
            n = len(packed.query) + len(item)
            if n > self.max_prompt_tokens:
                raise ScoreError(f"documents[{k}] makes a prompt of {n} tokens, more than the "
                                 f"maximum of {self.max_prompt_tokens}")
        unique = {}  # a document's prompt -> its row: equal documents are scored once, alike
        rows = [unique.setdefault(tuple(item), len(unique)) for item in packed.items]
        form = self.reranker.template.score
        scored = self.submit(ScoreRequest(
            packed.query, [list(item) for item in unique], self.reranker.label_ids,
            apply_softmax=not self.cfg.is_classifier and form == "softmax", model=req.model,
            raw_logits=form != "softmax"))
        relevances = lambda result: [relevance(  # noqa: E731
            result.scores[row], self.cfg.is_classifier, form, req.normalize) for row in rows]
        return _then(scored, lambda result: RerankResult(ranking(relevances(result), req.top_n),
                                                         result.prompt_tokens))

    def score_request(self, req: ScoreRequest) -> ScoreResult:
        return self.submit(req).result()

    def submit(self, req: ScoreRequest, pieces: list[list[int]] | None = None
               ) -> concurrent.futures.Future:
        """Queues the request; its future gives a ScoreResult, or raises ScoreError.
        Cancelling the future drops its waiting work. Bad requests raise here. `pieces`: a
        text request's query and items tokenized already (submit_all)."""
        job, units, key = self.prepare(req, pieces)
        if units:
            self.schedulers[self.router.pick(key)].submit(job, units)
        return job.future

    def submit_all(self, reqs: list[ScoreRequest]) -> list[concurrent.futures.Future]:
        """`submit` of each, the texts of all tokenized in one call of the tokenizer's batch
        encoding (the interpreter lock released while it runs); a bad request's future
        raises its ScoreError (or a bug's exception), the others' go on."""
        texts = [text for req in reqs if req.is_text for text in (req.query, *req.items)]
        with jax.profiler.TraceAnnotation("tokenize"):
            tokens = iter(self.token_cache.encode_pieces(texts))
        futures = []
        for req in reqs:
            pieces = [next(tokens) for _ in range(1 + len(req.items))] if req.is_text else None
            try:
                futures.append(self.submit(req, pieces))
            except Exception as e:  # this request's alone: the others go on
                futures.append(concurrent.futures.Future())
                futures[-1].set_exception(e)
        return futures

    def prepare(self, req: ScoreRequest, pieces: list[list[int]] | None = None
                ) -> tuple[Job, list[Unit], bytes | None]:
        """The request checked, tokenized (unless `pieces` are its text's tokens) and packed:
        its job, the job's units of work (none if it has no items: the job is answered), and
        the key that routes them. Bad requests raise here."""
        labels = self._labels(req)
        if pieces is not None:
            query, *items = pieces
        else:
            with jax.profiler.TraceAnnotation("tokenize"):
                query, items = self._tokenize(req)
        parts = self._packed(req, query, items)
        kind = ("label_softmax" if req.apply_softmax else
                "logits" if self.cfg.is_classifier or req.raw_logits else "vocab_probs")
        job = Job(labels, len(items), len(parts), kind)
        return job, [Unit(job, seq, scored) for seq, scored in parts], self._routing_key(req, parts)

    def _start_ids(self, req: ScoreRequest) -> list[int]:
        """What the tokenizer puts before a text prompt (e.g. BOS); ids come as they are."""
        return self.tokenizer.start_ids if req.is_text else []

    def _routing_key(self, req: ScoreRequest, parts: list[tuple[Sequence, range]]
                     ) -> bytes | None:
        """A digest of what the request's units share and the prefix cache may hold: the
        query as its packed sequences begin with it, unless items come first. None where
        there is one replica to route to."""
        if req.item_first or not parts or len(self.schedulers) == 1:
            return None
        seq = parts[0][0]
        return hashlib.blake2b(seq.tokens[:seq.shared_len].tobytes(), digest_size=16).digest()

    def _labels(self, req: ScoreRequest) -> list[int]:
        if self.cfg.is_classifier:
            return list(range(self.cfg.num_labels))
        check_token_ranges([req.label_token_ids], self.cfg.vocab_size,
                           lambda _: "label_token_ids")
        if len(req.label_token_ids) > self.engine_cfg.max_labels:
            raise ScoreError(f"label_token_ids has {len(req.label_token_ids)} ids, more than "
                             f"the maximum of {self.engine_cfg.max_labels} (--max-labels)")
        return list(req.label_token_ids)

    def _packed(self, req: ScoreRequest, query, items) -> list[tuple[Sequence, range]]:
        """The request's sequences (`_sequences`), token ids checked against the vocabulary
        on the packed arrays, a min and a max a sequence; the lists are searched for the id
        to name only where one is out."""
        try:
            parts = self._sequences(req, query, items) if items else []
        except OverflowError:  # an id beyond int32, which the packing's arrays refuse
            parts = None
        if not req.is_text and (not parts or not all(
                seq.tokens.min() >= 0 and seq.tokens.max() < self.cfg.vocab_size
                for seq, _ in parts)):
            check_token_ranges([req.query, *req.items], self.cfg.vocab_size,
                               lambda k: f"items[{k - 1}]" if k else "query")
        return parts

    def _tokenize(self, req: ScoreRequest) -> tuple[list[int], list[list[int]]]:
        if not req.is_text:
            return req.query, req.items
        query, *items = self.token_cache.encode_pieces([req.query, *req.items])
        return query, items

    @staticmethod
    def _prompt_check(n: int, k: int, limit: int) -> None:
        if n == 0:
            raise ScoreError(f"the prompt of items[{k}] is empty: nothing to score")
        if n > limit:
            raise ScoreError(f"the prompt of items[{k}] has {n} tokens, more than the "
                             f"maximum of {limit}")

    def _sequences(self, req: ScoreRequest, query, items) -> list[tuple[Sequence, range]]:
        """The request's sequences, each with the items it scores. item_first: one causal
        sequence per item; otherwise multi-item sequences of the query and as many items as
        one forward and the model's context take."""
        start, limit = self._start_ids(req), self.max_prompt_tokens
        if req.item_first:
            seqs = [causal_sequence(start + item + query) for item in items]
            for k, s in enumerate(seqs):
                self._prompt_check(len(s.tokens), k, limit)
            return [(s, range(k, k + 1)) for k, s in enumerate(seqs)]
        head, lens = start + query, list(map(len, items))
        if not 0 < len(head) + min(lens) <= len(head) + max(lens) <= limit:
            for k, n in enumerate(lens):  # names the first item out of bounds
                self._prompt_check(len(head) + n, k, limit)
        chunks = item_chunks(len(head), lens, limit, self.engine_cfg.max_rows)
        return [(multi_item_sequence(head, items[c.start:c.stop]), c) for c in chunks]


def _reranker(name: str, tokenizer: TextTokenizer,
              cfg: ModelConfig) -> tuple[Reranker | None, str]:
    """The rerank template named, or by default the built-in one where this vocabulary holds
    its labels (a classifier of one or two classes needs none); when there is none, why."""
    if cfg.is_classifier and cfg.num_labels > 2:
        why = f"a classifier of {cfg.num_labels} classes cannot rerank (one or two are needed)"
        if name:
            raise ValueError(f"--rerank-template: {why}")
        return None, why
    try:
        return Reranker(load_template(name or QWEN3_RERANKER), tokenizer,
                        with_labels=not cfg.is_classifier), ""
    except ValueError as e:
        if name:
            raise
        why = f"{e} (--rerank-template names another template)"
        logging.info("reranking is off: %s", why)
        return None, why


def _then(source: concurrent.futures.Future, fn) -> concurrent.futures.Future:
    """A future of `fn(source's result)`, failing as `source` fails; cancelling it cancels
    `source`."""
    out = concurrent.futures.Future()
    out.add_done_callback(lambda f: f.cancelled() and source.cancel())

    def settle(f):
        try:
            if f.cancelled():
                out.cancel()
            elif f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result(fn(f.result()))
        except concurrent.futures.InvalidStateError:
            pass  # cancelled meanwhile: nobody waits for it
    source.add_done_callback(settle)
    return out
