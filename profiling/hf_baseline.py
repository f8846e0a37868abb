"""HuggingFace transformers scoring the same prompts, the baselines of the comparison studies.

Optional: needs `torch` and `transformers` (`make bench-compare` installs them). On the CPU (as
many threads as JAX) or a CUDA GPU, in the server's dtype, the items of a request batched,
`logits_to_keep=1`. Two ways a careful script scores a request:
- per item: one prompt (query ++ item) per item;
- query KV reuse: the query's KV computed once, then every item's tokens on top of it
  (`past_key_values`), so each request computes the same tokens as multi-item scoring.
"""
import os
import statistics
import time

import numpy as np

from model.loader import embedded_model_path
from runtime.request import ScoreRequest


class HfScorer:
    def __init__(self, model, torch, reuse_query_kv: bool):
        self.model, self.torch, self.reuse_query_kv = model, torch, reuse_query_kv
        torch.set_num_threads(os.cpu_count())  # as many as XLA's CPU client uses

    @classmethod
    def from_path(cls, model_path: str | None, reuse_query_kv: bool = False,
                  dtype: str = "float32", device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM
        path = model_path or embedded_model_path()
        kw = {}
        if path.endswith(".gguf"):
            path, kw["gguf_file"] = os.path.split(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **kw)
        return cls(model.to(device).eval(), torch, reuse_query_kv)

    @property
    def device_name(self) -> str:
        device = self.model.device
        if device.type == "cuda":
            return self.torch.cuda.get_device_name(device)
        return device.type

    def with_reuse(self, reuse_query_kv: bool) -> "HfScorer":
        """The same model, scoring the other way."""
        return HfScorer(self.model, self.torch, reuse_query_kv)

    def scores(self, req: ScoreRequest) -> np.ndarray:
        """P(label | query ++ item) over the full vocabulary, [items, labels]."""
        if len({len(item) for item in req.items}) != 1:
            raise ValueError("the baseline batches equal-length items only (no padding)")
        torch, device = self.torch, self.model.device
        with torch.inference_mode():
            if self.reuse_query_kv:
                query = torch.tensor([req.query], device=device)
                cache = self.model(query, use_cache=True).past_key_values
                cache.batch_repeat_interleave(len(req.items))
                logits = self.model(torch.tensor(req.items, device=device), past_key_values=cache,
                                    use_cache=True, logits_to_keep=1).logits[:, -1]
            else:
                prompts = torch.tensor([req.query + item for item in req.items], device=device)
                logits = self.model(prompts, logits_to_keep=1).logits[:, -1]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
        # .cpu() waits for the device: the scores are in hand when this returns.
        return logprobs[:, req.label_token_ids].exp().cpu().numpy().astype(np.float64)

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
