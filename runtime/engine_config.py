"""Runtime configuration, validated once, and the sizes derived from it and the model."""
import dataclasses

from kernels.attention_plan import BlockSizes, default_block_sizes
from kernels.backends import KERNEL_BACKENDS, TPU_BACKENDS
from model.config import QUANTIZATIONS, ModelConfig
from model.loader import DTYPES, checkpoint_dtype
from runtime.buckets import ShapeBuckets, pages_needed
from runtime.wait_queue import SCHEDULE_POLICIES


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    dtype: str = "float32"          # or bfloat16; "auto": resolved by resolve_dtype
    page_size: int = 16
    max_prefill_tokens: int = 8192  # new tokens in one forward
    max_seqs: int = 64              # sequences in one forward
    max_rows: int = 256             # scored items in one forward
    max_labels: int = 64            # label ids of one request
    kv_cache_tokens: int = 0        # KV pool size; 0: sized by runtime.pool_size
    mem_fraction: float = 0.8       # share of accelerator memory for params, pool and temp
    prefix_cache: bool = True
    schedule_policy: str = "fair"   # or "fcfs": the order waiting units take forwards in
    pipeline_depth: int = 2         # forwards in flight at once; 1: one after another
    warmup: bool = True             # compile every shape bucket at start-up
    kernel_backend: str = "auto"    # "auto": the Pallas kernels on TPU, the XLA path elsewhere
    q_block: int = 0                # attention block sizes; 0: from the table for this device
    kv_block: int = 0
    tp_size: int = 1                # devices per replica: one tensor-parallel mesh
    dp_size: int = 1                # replicas, each on its own devices
    rerank_template: str = ""       # a built-in name or a JSON file; "": Qwen3-Reranker's,
    #                                 where the vocabulary holds its labels
    program_cache_dir: str = ""     # compiled programs kept for the next start; "": none
    quantization: str = ""          # "int8": the checkpoint's layers quantized at load (W8A8)
    replica_processes: bool = False  # each replica in an engine process of its own
    #                                  (runtime.replica_process); the server's with dp_size > 1

    def __post_init__(self):
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got "
                             f"{self.dtype!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got "
                             f"{self.schedule_policy!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got "
                             f"{self.quantization!r}")
        if self.kernel_backend not in ("auto",) + KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be auto or one of {KERNEL_BACKENDS}")
        positive = ("page_size", "max_prefill_tokens", "max_seqs", "max_rows", "max_labels",
                    "tp_size", "dp_size", "pipeline_depth")
        if any(getattr(self, name) <= 0 for name in positive) or not 0 < self.mem_fraction <= 1:
            raise ValueError(f"{positive} must be positive and mem_fraction in (0, 1]: {self}")
        if min(self.q_block, self.kv_block, self.kv_cache_tokens) < 0:
            raise ValueError(f"q_block, kv_block and kv_cache_tokens may not be negative: {self}")
        if max(self.page_size, self.max_seqs, self.max_rows) > self.max_prefill_tokens:
            raise ValueError("page_size, max_seqs and max_rows may not exceed max_prefill_tokens")
        if self.kv_cache_tokens and self.kv_cache_tokens < self.min_kv_tokens:
            raise ValueError(f"kv_cache_tokens={self.kv_cache_tokens} cannot hold one batch: "
                             f"at least {self.min_kv_tokens} are needed")

    def resolve_dtype(self, model_path: str | None, platform: str) -> "EngineConfig":
        """With dtype auto: float32 on CPU, the checkpoint's dtype on accelerators."""
        if self.dtype != "auto":
            return self
        dtype = "float32" if platform == "cpu" else checkpoint_dtype(model_path)
        return dataclasses.replace(self, dtype=dtype)

    @property
    def min_kv_tokens(self) -> int:
        """One full batch: every sequence may waste a partial page."""
        pages = pages_needed(self.max_prefill_tokens, self.page_size) + self.max_seqs
        return pages * self.page_size

    def device_groups(self, devices: list) -> list[list]:
        """dp_size disjoint groups of tp_size of `devices`, in their order."""
        tp, need = self.tp_size, self.tp_size * self.dp_size
        if need > len(devices):
            raise ValueError(f"--tp-size {tp} x --dp-size {self.dp_size} needs {need} devices; "
                             f"{len(devices)} {devices[0].platform} devices are visible")
        return [devices[r * tp:(r + 1) * tp] for r in range(self.dp_size)]

    def backend(self, device) -> str:
        """The kernels for `device` (a jax Device, or a deviceless topology's)."""
        if self.kernel_backend != "auto":
            return self.kernel_backend
        return "pallas" if device.platform == "tpu" else "xla"

    def block_sizes(self, device) -> BlockSizes | None:
        backend = self.backend(device)
        if backend == "reference":
            return None
        kind = device.device_kind if backend != "xla" else f"xla {device.platform}"
        default = default_block_sizes(kind, self.page_size)
        sizes = default.with_blocks(self.q_block or default.q_block,
                                    self.kv_block or default.kv_block)
        sizes.check(self.page_size)
        return sizes

    def buckets(self, cfg: ModelConfig, device) -> ShapeBuckets:
        labels = cfg.num_labels if cfg.is_classifier else self.max_labels
        return ShapeBuckets(self.max_prefill_tokens, self.max_seqs, self.max_rows, labels,
                            self.max_prompt_tokens(cfg), self.page_size, self.block_sizes(device),
                            page_aligned=self.backend(device) in TPU_BACKENDS)

    def max_prompt_tokens(self, cfg: ModelConfig) -> int:
        return min(cfg.max_context, self.max_prefill_tokens)
