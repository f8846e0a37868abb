"""The forward's kernels, each with a plain-JAX reference of the same signature beside it.

Public: the kernels (KV write, attention, label gather; on TPU also the projections, which
can norm their input, add to the residual stream and write k and v into their pages, the
whole MLP in one kernel, in 16 bits or int8, after the output projection where it fits,
q's and k's norm and RoPE, and x normed and quantized for int8 projections) and their
backends (`select_kernels` picks one implementation of each), the attention metadata and the
block plan the planned kernels walk (built in the program: `plan_attention`; from concrete
metadata: `build_plan`).
"""
from kernels.attention_plan import (
    AttentionPlan,
    BlockSizes,
    build_plan,
    default_block_sizes,
    plan_attention,
)
from kernels.backends import KERNEL_BACKENDS, TPU_BACKENDS, KernelSet, select_kernels
from kernels.kv_write_kernel import write_kv_pages_kernel
from kernels.label_gather import final_norm_label_gather_reference, final_norm_label_gather_xla
from kernels.label_gather_kernel import final_norm_label_gather
from kernels.mlp_kernel import (
    mlp,
    mlp_kernel_applies,
    mlp_reference,
    out_and_mlp,
    out_and_mlp_reference,
)
from kernels.projection_kernel import (
    InputNorm,
    PageWrite,
    gated_up,
    gated_up_reference,
    project,
    project_reference,
    projection_kernel_applies,
)
from kernels.quantize_kernel import quantized_rows, quantized_rows_reference
from kernels.ragged_paged_attention import (
    AttentionMetadata,
    ragged_paged_attention_reference,
    write_kv_pages,
    written_pages,
)
from kernels.ragged_paged_attention_kernel import ragged_paged_attention
from kernels.ragged_paged_attention_xla import ragged_paged_attention_xla
from kernels.rms_norm import rms_norm
from kernels.rope_kernel import qk_norm_rope, qk_norm_rope_reference, rope_lane_tables

__all__ = [
    "AttentionMetadata", "AttentionPlan", "BlockSizes", "InputNorm", "KERNEL_BACKENDS",
    "KernelSet", "PageWrite", "TPU_BACKENDS", "build_plan", "default_block_sizes",
    "final_norm_label_gather",
    "final_norm_label_gather_reference", "final_norm_label_gather_xla", "gated_up",
    "gated_up_reference", "mlp", "mlp_kernel_applies", "mlp_reference", "out_and_mlp",
    "out_and_mlp_reference", "plan_attention", "project", "project_reference",
    "projection_kernel_applies",
    "qk_norm_rope", "qk_norm_rope_reference", "quantized_rows", "quantized_rows_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference", "ragged_paged_attention_xla", "rms_norm",
    "rope_lane_tables", "select_kernels", "write_kv_pages", "write_kv_pages_kernel",
    "written_pages",
]
