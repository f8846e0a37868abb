"""The engine's flags, shared by the server (`python -m server`) and the batch command
(`python -m server.batch`): the model, its shapes and memory, the kernels and the devices."""
import os

import jax
from absl import app, flags, logging

from kernels.backends import KERNEL_BACKENDS
from model.loader import model_name
from runtime.distributed import DistConfig
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from runtime.model_runner import ModelRunner
from runtime.wait_queue import SCHEDULE_POLICIES

FLAGS = flags.FLAGS


def default_compile_cache_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "jax-score")


def define_engine_flags() -> None:
    flags.DEFINE_string("model_path", None, "HF checkpoint directory or .gguf file; "
                        "default: the embedded SmolLM2-135M-Instruct")
    flags.DEFINE_string("served_model_name", None, "the model's name in /v1/models and in "
                        "every response; default: the checkpoint directory's (or GGUF file's)")
    flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16"], "weights, activations "
                      "and KV; auto: float32 on CPU, the checkpoint's dtype on accelerators "
                      "(bfloat16 unless it is stored in float32). float32 multiplies in "
                      "float32 on every device: no TF32 on GPUs")
    flags.DEFINE_integer("page_size", 16, "tokens per KV page")
    flags.DEFINE_integer("max_prefill_tokens", 8192, "new tokens in one forward pass")
    flags.DEFINE_integer("max_seqs", 64, "sequences in one forward pass")
    flags.DEFINE_integer("max_rows", 256, "scored items in one forward pass")
    flags.DEFINE_integer("max_labels", 64, "label_token_ids of one request")
    flags.DEFINE_string("rerank_template", "", "the prompt /v1/rerank scores: a built-in "
                        "template's name (qwen3-reranker, bge-reranker-v2-gemma, "
                        "mxbai-rerank-v2) or a JSON file of prefix, body, suffix, labels, "
                        "score and default_instruct; default: qwen3-reranker where the "
                        "vocabulary holds its labels, else reranking is off")
    flags.DEFINE_integer("kv_cache_tokens", 0, "KV pool size in tokens; 0: --mem-fraction of "
                         "free accelerator memory (4 batches on CPU)")
    flags.DEFINE_float("mem_fraction", 0.8, "share of accelerator memory for params and KV")
    flags.DEFINE_bool("disable_prefix_cache", False, "recompute every query")
    flags.DEFINE_bool("skip_warmup", False, "compile shape buckets on first use, not at start")
    flags.DEFINE_string("compile_cache_dir", default_compile_cache_dir(), "where compiled "
                        "programs are kept for the next start: the server's forwards under "
                        "programs/, found without tracing them, and JAX's persistent "
                        "compilation cache under xla/; '' turns both off")
    flags.DEFINE_enum("schedule_policy", "fair", list(SCHEDULE_POLICIES), "fair: requests "
                      "least recently served go first, so a small request is not held behind "
                      "a large one's forwards; fcfs: first come, first served")
    flags.DEFINE_integer("pipeline_depth", 2, "forwards in flight at once: the host prepares "
                         "the next while the devices run one; 1: one after another")
    flags.DEFINE_integer("q_block", 0, "attention: query tokens per block; 0: the device's "
                         "entry in the block-size table")
    flags.DEFINE_integer("kv_block", 0, "attention: KV positions per block, a multiple of "
                         "--page-size; 0: the device's entry in the block-size table")
    flags.DEFINE_enum("kernel_backend", "auto", ["auto", *KERNEL_BACKENDS],
                      "the KV write, attention and label gather kernels: auto: the Pallas "
                      "kernels on TPU, the planned XLA path elsewhere")
    flags.DEFINE_alias("attention_backend", "kernel_backend")  # SGLang's name
    flags.DEFINE_enum("quantization", "none", ["none", "int8"], "int8: the layers' "
                      "projections and MLP in int8 (W8A8: weights per channel, smoothed and "
                      "quantized at load; activations per token); TPU v5e, v5p, v6e, or the "
                      "XLA path elsewhere")
    flags.DEFINE_integer("tp_size", 1, "devices per replica: attention heads, MLP and "
                         "vocabulary split over them")
    flags.DEFINE_integer("dp_size", 1, "replicas, each on its own --tp-size devices: a request "
                         "goes to the least loaded, a repeated query to the one that took it")
    flags.DEFINE_string("dist_init_addr", None, "multi-host: node 0's HOST:PORT for "
                        "jax.distributed")
    flags.DEFINE_integer("nnodes", 1, "multi-host: hosts, one process each")
    flags.DEFINE_integer("node_rank", 0, "multi-host: this host's rank; node 0 serves HTTP, "
                         "the others run its forwards")


def engine_config() -> EngineConfig:
    return EngineConfig(
        dtype=FLAGS.dtype, page_size=FLAGS.page_size, max_prefill_tokens=FLAGS.max_prefill_tokens,
        max_seqs=FLAGS.max_seqs, max_rows=FLAGS.max_rows, max_labels=FLAGS.max_labels,
        kv_cache_tokens=FLAGS.kv_cache_tokens, mem_fraction=FLAGS.mem_fraction,
        prefix_cache=not FLAGS.disable_prefix_cache, warmup=not FLAGS.skip_warmup,
        schedule_policy=FLAGS.schedule_policy, pipeline_depth=FLAGS.pipeline_depth,
        kernel_backend=FLAGS.kernel_backend, q_block=FLAGS.q_block,
        kv_block=FLAGS.kv_block, tp_size=FLAGS.tp_size, dp_size=FLAGS.dp_size,
        rerank_template=FLAGS.rerank_template,
        quantization="" if FLAGS.quantization == "none" else FLAGS.quantization,
        replica_processes=FLAGS.dp_size > 1,
        program_cache_dir=os.path.join(FLAGS.compile_cache_dir, "programs")
        if FLAGS.compile_cache_dir else "")


def xla_cache_dir(path: str) -> str:
    """Where JAX's compilation cache lies in a --compile-cache-dir of `path`."""
    return os.path.join(path, "xla")


def use_compile_cache(path: str) -> None:
    """Every program JAX compiles is kept under `path`/xla and read back on the next start
    (the forwards under `path`/programs: EngineConfig.program_cache_dir)."""
    if path:
        jax.config.update("jax_compilation_cache_dir", xla_cache_dir(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        logging.info("compilation cache: %s", path)


def served_model_name() -> str:
    return FLAGS.served_model_name or model_name(FLAGS.model_path)


def start_engine(runner_type=ModelRunner) -> Engine:
    """The engine, after joining the other hosts; a bad flag is a usage error. `runner_type`:
    as Engine's."""
    use_compile_cache(FLAGS.compile_cache_dir)
    try:
        dist = DistConfig(FLAGS.dist_init_addr, FLAGS.nnodes, FLAGS.node_rank)
        dist.initialize()
        return Engine.from_path(FLAGS.model_path, engine_config(), runner_type)
    except ValueError as e:
        raise app.UsageError(str(e)) from e
