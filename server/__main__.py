"""python -m server --model-path PATH --host H --port P --dtype D

Flags may be spelled as in SGLang (--model-path) or as in absl (--model_path).
"""
import asyncio

from absl import app, flags, logging

from model.decoder import ATTENTION_BACKENDS
from runtime.engine import Engine, EngineConfig
from server.app import ScoreServer, ServerConfig

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("model_path", None, "HF checkpoint directory or .gguf file; "
                        "default: the embedded SmolLM2-135M-Instruct")
    flags.DEFINE_string("host", "127.0.0.1", "address to bind")
    flags.DEFINE_integer("port", 30000, "port to bind")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights and activations")
    flags.DEFINE_integer("page_size", 16, "tokens per KV page")
    flags.DEFINE_integer("max_batch_tokens", 8192, "new tokens in one forward pass")
    flags.DEFINE_integer("max_body_bytes", 8 << 20, "largest request body accepted")
    flags.DEFINE_enum("attention_backend", "auto", ["auto", *ATTENTION_BACKENDS],
                      "auto: the Pallas kernel on TPU, the plain-JAX reference elsewhere")


async def serve() -> None:
    engine = Engine.from_path(FLAGS.model_path, EngineConfig(
        dtype=FLAGS.dtype, page_size=FLAGS.page_size, max_batch_tokens=FLAGS.max_batch_tokens,
        attention_backend=FLAGS.attention_backend))
    server = ScoreServer(engine, ServerConfig(model_name=FLAGS.model_path or "default",
                                              max_body_bytes=FLAGS.max_body_bytes))
    listener = await server.start(FLAGS.host, FLAGS.port)
    port = listener.sockets[0].getsockname()[1]
    logging.info("serving %s on http://%s:%d", FLAGS.model_path or "SmolLM2-135M (embedded)",
                 FLAGS.host, port)
    try:
        async with listener:
            await listener.serve_forever()
    finally:
        server.close()


def _underscored(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg[2:].partition("=")
    return "--" + name.replace("-", "_") + eq + value


def parse_flags(argv: list[str]) -> list[str]:
    return FLAGS([argv[0]] + [_underscored(a) for a in argv[1:]])


def main(argv) -> None:
    del argv
    asyncio.run(serve())


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
