"""Which implementation runs each of the forward's kernels: the KV write, the ragged paged
attention, the final-norm label gather and (TPU) the projections, the MLP and q's and k's
norm and RoPE. One backend picks them all."""
import functools
from typing import Callable, NamedTuple

from jax.experimental.pallas import tpu as pltpu

from kernels.attention_plan import BlockSizes
from kernels.kv_write_kernel import write_kv_pages_kernel
from kernels.label_gather import final_norm_label_gather_reference, final_norm_label_gather_xla
from kernels.label_gather_kernel import final_norm_label_gather
from kernels.mlp_kernel import mlp, out_and_mlp
from kernels.projection_kernel import gated_up, project
from kernels.ragged_paged_attention import ragged_paged_attention_reference, write_kv_pages
from kernels.ragged_paged_attention_kernel import ragged_paged_attention
from kernels.ragged_paged_attention_xla import ragged_paged_attention_xla
from kernels.rope_kernel import qk_norm_rope

KERNEL_BACKENDS = ("reference", "xla", "pallas", "interpret")
TPU_BACKENDS = ("pallas", "interpret")  # the Pallas kernels, compiled or interpreted


class KernelSet(NamedTuple):
    write: Callable   # (k_pages, v_pages, layer, k_blocks, v_blocks, page_ids) -> pages
    attend: Callable  # (q, k_pages, v_pages, layer, metadata) -> [T, Hq, D]
    gather: Callable  # (hidden, norm, head, label_ids, *, eps, with_logsumexp, num_rows,
    #                   num_labels) -> (logits, lse)
    rope: Callable | None = None  # (q, k, cos, sin, q_norm, k_norm, *, head_dim, eps) -> q, k
    #                               in the projections' layout; None: the model's XLA ops
    project: Callable | None = None  # (x, weights, biases, *, out_dtype, rope, name) -> x @
    #                                  each weight (+ its bias), the first normed and rotated
    #                                  with `rope`; None: the model's XLA dots
    gated_up: Callable | None = None  # (x, w_gate, w_up, *, name, activation, hadamard) ->
    #                                   activation(x @ w_gate) * (x @ w_up); None: the
    #                                   model's XLA ops
    mlp: Callable | None = None  # (x, w_gate, w_up, w_down, *, layer, x_norm, residual,
    #                              out_dtype, name) -> the whole MLP and its residual add in
    #                              one kernel; None: gate_up and the down projection
    out_and_mlp: Callable | None = None  # (attn, wo, residual, w_gate, w_up, w_down, *, layer,
    #                                      x_norm, name) -> the output projection, its
    #                                      residual add and the MLP's, in one kernel


def select_kernels(backend: str, *, sm_scale: float, max_q_len: int,
                   sizes: BlockSizes | None, softcap: float = 0.0) -> KernelSet:
    """reference: dense plain JAX, the tests' oracle; xla: the planned XLA loops (CPU, GPU),
    work following the real rows and visible KV blocks; pallas: the TPU kernels; interpret:
    the same kernels in the TPU interpreter (CPU tests). All but reference need
    metadata.plan. `softcap`: the attention scores' (Gemma 2's; 0: none)."""
    kw = dict(sm_scale=sm_scale, max_q_len=max_q_len, softcap=softcap)
    if backend == "reference":
        return KernelSet(write_kv_pages,
                         functools.partial(ragged_paged_attention_reference, **kw),
                         final_norm_label_gather_reference)
    if backend == "xla":
        return KernelSet(write_kv_pages,
                         functools.partial(ragged_paged_attention_xla, sizes=sizes, **kw),
                         final_norm_label_gather_xla)
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel backend must be one of {KERNEL_BACKENDS}, got {backend!r}")
    interpret = pltpu.InterpretParams() if backend == "interpret" else False
    return KernelSet(
        functools.partial(write_kv_pages_kernel, interpret=interpret),
        functools.partial(ragged_paged_attention, sizes=sizes, interpret=interpret, **kw),
        functools.partial(final_norm_label_gather, interpret=interpret),
        functools.partial(qk_norm_rope, interpret=interpret),
        functools.partial(project, interpret=interpret),
        functools.partial(gated_up, interpret=interpret),
        functools.partial(mlp, interpret=interpret),
        functools.partial(out_and_mlp, interpret=interpret))
