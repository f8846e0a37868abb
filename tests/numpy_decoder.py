"""An independent float64 NumPy implementation of the HF decoders, for one plain prompt:
Llama, Qwen2, Qwen3, Mistral and Gemma 1-3, each as transformers' modeling file computes it
(read from config.json here, not from model.config)."""
import glob
import json
import os

import numpy as np
from safetensors.numpy import load_file


class NumpyDecoder:
    def __init__(self, model_dir: str, int8: bool = False, smoothing: dict | None = None,
                 rotation: np.ndarray | None = None, hadamard: int = 0):
        """`int8`: the layers' linears as W8A8 (weights per output channel and activations per
        token, symmetric, rounded to nearest; an all-zero row's scale 1). `smoothing`: the
        factors of model.smoothing.smoothing_factors folded into the weights first.
        `rotation`: the residual stream in the basis of this orthogonal [H, H] (QuaRot's: the
        norms before the sublayers folded into the weights that read it); `hadamard`: down's
        input times Sylvester's +-1 matrix of this size in each block of as many features."""
        self.int8, self.rotation = int8, rotation
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
        self.gemma = self.arch.startswith("Gemma")
        self.sandwich = self.arch.startswith(("Gemma2", "Gemma3"))
        self.scale = (c["query_pre_attn_scalar"] if self.sandwich else self.d) ** -0.5
        self.windows = [self._window(i) for i in range(c["num_hidden_layers"])]
        if smoothing is not None:
            self._smooth(smoothing)
        if rotation is not None:
            self._rotate(rotation)
        self.spread = None  # down's input times this [I, I] block-diagonal +-1 matrix
        if hadamard:
            self.spread = np.kron(np.eye(c["intermediate_size"] // hadamard),
                                  _sylvester(hadamard))
            self._fold_hadamard(hadamard)

    def _rotate(self, q):
        """HF's y = x W^T: a reader's W becomes W diag(norm) Q, a writer's Q^T W (o's bias
        b Q); the norms before the sublayers become 1."""
        for layer in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            for norm, readers in (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj",
                                                       "self_attn.v_proj")),
                                  ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))):
                w = self.t[p + norm + ".weight"]
                scale = 1 + w if self.gemma else w
                for name in readers:
                    self.t[p + name + ".weight"] = (self.t[p + name + ".weight"] * scale) @ q
                self.t[p + norm + ".weight"] = np.zeros_like(w) if self.gemma else np.ones_like(w)
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                self.t[p + name + ".weight"] = q.T @ self.t[p + name + ".weight"]
            if p + "self_attn.o_proj.bias" in self.t:
                self.t[p + "self_attn.o_proj.bias"] = self.t[p + "self_attn.o_proj.bias"] @ q

    def _fold_hadamard(self, block: int):
        for layer in range(self.cfg["num_hidden_layers"]):
            name = f"model.layers.{layer}.mlp.down_proj.weight"
            self.t[name] = self.t[name] @ self.spread / block

    def _smooth(self, factors: dict):
        """SmoothQuant's folding, in HF's layout ([out, in] weights, norms 1 + w in Gemma)."""
        rep = self.heads // self.kv_heads
        mlp_norm = "pre_feedforward_layernorm" if self.sandwich else "post_attention_layernorm"
        for layer in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            f = {k: v[layer].astype(np.float64) for k, v in factors.items()}
            o_in = np.repeat(f["v"].reshape(self.kv_heads, 1, self.d), rep, axis=1).ravel()
            for name, by in (("self_attn.q_proj", f["qkv"]), ("self_attn.k_proj", f["qkv"]),
                             ("self_attn.v_proj", f["qkv"]), ("mlp.gate_proj", f["gate_up"]),
                             ("mlp.up_proj", f["gate_up"]), ("mlp.down_proj", f["down"]),
                             ("self_attn.o_proj", o_in)):
                self.t[p + name + ".weight"] = self.t[p + name + ".weight"] * by
            for name, by in (("mlp.up_proj.weight", f["down"][:, None]),
                             ("self_attn.v_proj.weight", f["v"][:, None]),
                             ("self_attn.v_proj.bias", f["v"])):
                if p + name in self.t:
                    self.t[p + name] = self.t[p + name] / by
            for name, by in (("input_layernorm", f["qkv"]), (mlp_norm, f["gate_up"])):
                w = self.t[p + name + ".weight"]
                self.t[p + name + ".weight"] = (1 + w) / by - 1 if self.gemma else w / by

    def _window(self, layer: int):
        w = self.cfg.get("sliding_window")
        if self.arch.startswith("Mistral"):
            return w
        if self.arch.startswith("Gemma2"):
            return w if layer % 2 == 0 else None
        if self.arch.startswith("Gemma3"):
            return None if (layer + 1) % self.cfg.get("sliding_window_pattern", 6) == 0 else w
        return None

    def _norm(self, x, w):
        scale = 1.0 + w if self.gemma else w
        return scale * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps)

    def _rope(self, x, layer):  # x [n, heads, d], positions 0..n-1
        n, d = x.shape[0], self.d
        theta, factor = self.cfg["rope_theta"], 1.0
        if self.arch.startswith("Gemma3") and self.windows[layer]:
            theta = self.cfg["rope_local_base_freq"]
        elif (self.cfg.get("rope_scaling") or {}).get("rope_type") == "linear":
            factor = self.cfg["rope_scaling"]["factor"]
        inv = 1.0 / theta ** (np.arange(0, d, 2) / d) / factor
        ang = np.arange(n)[:, None] * inv[None]
        cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
        rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos[:, None] + rot * sin[:, None]

    def _lin(self, x, name):
        w = self.t[name + ".weight"]
        y = _int8_product(x, w) if self.int8 else x @ w.T
        return y + self.t[name + ".bias"] if name + ".bias" in self.t else y

    def _attention(self, x, p, layer):
        n = x.shape[0]
        q = self._lin(x, p + "q_proj").reshape(n, self.heads, self.d)
        k = self._lin(x, p + "k_proj").reshape(n, self.kv_heads, self.d)
        v = self._lin(x, p + "v_proj").reshape(n, self.kv_heads, self.d)
        if self.arch.startswith(("Qwen3", "Gemma3")):
            q, k = self._norm(q, self.t[p + "q_norm.weight"]), self._norm(k, self.t[p + "k_norm.weight"])
        q, k = self._rope(q, layer), self._rope(k, layer)
        rep = self.heads // self.kv_heads
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) * self.scale
        if cap := self.cfg.get("attn_logit_softcapping"):
            s = cap * np.tanh(s / cap)
        qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
        visible = ki <= qi
        if self.windows[layer]:
            visible &= qi - ki < self.windows[layer]
        s = np.where(visible[None], s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        return self._lin(np.einsum("hqk,khd->qhd", pr, v).reshape(n, -1), p + "o_proj")

    def _act(self, x):
        if self.gemma:  # gelu_pytorch_tanh
            return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
        return x / (1 + np.exp(-x))

    def last_logits(self, prompt: list[int]) -> np.ndarray:
        """Output-head logits at the last prompt token (vocabulary, or classes)."""
        x = self.t["model.embed_tokens.weight"][prompt]
        if self.gemma:
            x = x * np.sqrt(self.cfg["hidden_size"])
        if self.rotation is not None:
            x = x @ self.rotation
        for layer in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            n = lambda y, name: self._norm(y, self.t[p + name + ".weight"])  # noqa: E731
            a = self._attention(n(x, "input_layernorm"), p + "self_attn.", layer)
            x = x + (n(a, "post_attention_layernorm") if self.sandwich else a)
            h = n(x, "pre_feedforward_layernorm" if self.sandwich else "post_attention_layernorm")
            gate, up = self._lin(h, p + "mlp.gate_proj"), self._lin(h, p + "mlp.up_proj")
            inner = self._act(gate) * up
            if self.spread is not None:
                inner = inner @ self.spread
            m = self._lin(inner, p + "mlp.down_proj")
            x = x + (n(m, "post_feedforward_layernorm") if self.sandwich else m)
        last = x[-1] if self.rotation is None else x[-1] @ self.rotation.T
        h = self._norm(last, self.t["model.norm.weight"])
        head = self.t.get("score.weight", self.t.get("lm_head.weight", self.t["model.embed_tokens.weight"]))
        z = head @ h
        if cap := self.cfg.get("final_logit_softcapping"):
            z = cap * np.tanh(z / cap)
        return z

    def scores(self, prompt: list[int], labels: list[int], apply_softmax: bool) -> np.ndarray:
        z = self.last_logits(prompt)
        if self.arch.endswith("SequenceClassification"):
            return np.exp(z - z.max()) / np.exp(z - z.max()).sum() if apply_softmax else z
        if apply_softmax:
            zl = z[labels]
            return np.exp(zl - zl.max()) / np.exp(zl - zl.max()).sum()
        lse = z.max() + np.log(np.exp(z - z.max()).sum())
        return np.exp(z[labels] - lse)


def _int8_rows(a):
    """Each row of `a` as int8 values (float64) and its scale."""
    scale = np.max(np.abs(a), axis=-1, keepdims=True) / 127
    scale = np.where(scale > 0, scale, 1.0)
    return np.clip(np.rint(a / scale), -127, 127), scale


def _int8_product(x, w):
    (xq, xs), (wq, ws) = _int8_rows(x), _int8_rows(w)
    return (xq @ wq.T) * xs * ws.T


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h
