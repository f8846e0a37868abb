"""An independent float64 NumPy implementation of the HF decoders, for one plain prompt."""
import glob
import json
import os

import numpy as np
from safetensors.numpy import load_file


class NumpyDecoder:
    def __init__(self, model_dir: str):
        with open(os.path.join(model_dir, "config.json")) as f:
            self.cfg = json.load(f)
        self.t = {}
        for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
            self.t.update({k: v.astype(np.float64) for k, v in load_file(path).items()})
        c = self.cfg
        self.arch = c["architectures"][0]
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.d = c.get("head_dim") or c["hidden_size"] // self.heads
        self.eps = c["rms_norm_eps"]

    def _norm(self, x, w):
        return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps)

    def _rope(self, x):  # x [n, heads, d], positions 0..n-1
        n, d = x.shape[0], self.d
        inv = 1.0 / self.cfg["rope_theta"] ** (np.arange(0, d, 2) / d)
        ang = np.arange(n)[:, None] * inv[None]
        cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
        rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos[:, None] + rot * sin[:, None]

    def _lin(self, x, name):
        y = x @ self.t[name + ".weight"].T
        return y + self.t[name + ".bias"] if name + ".bias" in self.t else y

    def _attention(self, x, p):
        n = x.shape[0]
        q = self._lin(x, p + "q_proj").reshape(n, self.heads, self.d)
        k = self._lin(x, p + "k_proj").reshape(n, self.kv_heads, self.d)
        v = self._lin(x, p + "v_proj").reshape(n, self.kv_heads, self.d)
        if self.arch.startswith("Qwen3"):
            q, k = self._norm(q, self.t[p + "q_norm.weight"]), self._norm(k, self.t[p + "k_norm.weight"])
        q, k = self._rope(q), self._rope(k)
        rep = self.heads // self.kv_heads
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(self.d)
        s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        return self._lin(np.einsum("hqk,khd->qhd", pr, v).reshape(n, -1), p + "o_proj")

    def last_logits(self, prompt: list[int]) -> np.ndarray:
        """Output-head logits at the last prompt token (vocabulary, or classes)."""
        x = self.t["model.embed_tokens.weight"][prompt]
        for layer in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            x = x + self._attention(self._norm(x, self.t[p + "input_layernorm.weight"]), p + "self_attn.")
            h = self._norm(x, self.t[p + "post_attention_layernorm.weight"])
            gate, up = self._lin(h, p + "mlp.gate_proj"), self._lin(h, p + "mlp.up_proj")
            x = x + self._lin(gate / (1 + np.exp(-gate)) * up, p + "mlp.down_proj")
        h = self._norm(x[-1], self.t["model.norm.weight"])
        head = self.t.get("score.weight", self.t.get("lm_head.weight", self.t["model.embed_tokens.weight"]))
        return head @ h

    def scores(self, prompt: list[int], labels: list[int], apply_softmax: bool) -> np.ndarray:
        z = self.last_logits(prompt)
        if self.arch.endswith("SequenceClassification"):
            return np.exp(z - z.max()) / np.exp(z - z.max()).sum() if apply_softmax else z
        if apply_softmax:
            zl = z[labels]
            return np.exp(zl - zl.max()) / np.exp(zl - zl.max()).sum()
        lse = z.max() + np.log(np.exp(z - z.max()).sum())
        return np.exp(z[labels] - lse)
