"""HuggingFace transformers scoring the same prompts, for the engine benchmark's comparison.

Optional: needs `torch` and `transformers` (`make bench-compare` installs them). One prompt
(query ++ item) per item, the items of a request batched, logits_to_keep=1, float32.
"""
import os
import statistics
import time

import numpy as np

from model.loader import embedded_model_path
from runtime.request import ScoreRequest


class HfScorer:
    def __init__(self, model, torch):
        self.model, self.torch = model, torch
        torch.set_num_threads(os.cpu_count())  # as many as XLA's CPU client uses

    @classmethod
    def from_path(cls, model_path: str | None):
        import torch
        from transformers import AutoModelForCausalLM
        path = model_path or embedded_model_path()
        kw = {}
        if path.endswith(".gguf"):
            path, kw["gguf_file"] = os.path.split(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
        return cls(model.eval(), torch)

    def scores(self, req: ScoreRequest) -> np.ndarray:
        """P(label | query ++ item) over the full vocabulary, [items, labels]."""
        torch = self.torch
        prompts = [req.query + item for item in req.items]
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("the baseline batches equal-length prompts only (no padding)")
        with torch.inference_mode():
            logits = self.model(torch.tensor(prompts), logits_to_keep=1).logits[:, -1]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
        return logprobs[:, req.label_token_ids].exp().numpy().astype(np.float64)

    def time(self, reqs: list[ScoreRequest], repeats: int) -> dict:
        self.scores(reqs[0])  # warm-up
        total = statistics.median(self._wall(reqs) for _ in range(repeats))
        latency = statistics.median(self._wall(reqs[:1]) for _ in range(repeats))
        return {"items_per_s": sum(len(r.items) for r in reqs) / total, "latency_s": latency}

    def _wall(self, reqs: list[ScoreRequest]) -> float:
        start = time.perf_counter()
        for req in reqs:
            self.scores(req)
        return time.perf_counter() - start
