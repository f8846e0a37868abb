"""Command lines accept flags spelled as in SGLang (--model-path) or as in absl (--model_path)."""
from absl import flags


def _underscored(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg[2:].partition("=")
    return "--" + name.replace("-", "_") + eq + value


def parse_flags(argv: list[str]) -> list[str]:
    """An `app.run(flags_parser=...)` that also takes dashed flag names."""
    return flags.FLAGS([argv[0]] + [_underscored(a) for a in argv[1:]])
