"""Command lines accept flags spelled as in SGLang (--model-path) or as in absl (--model_path)."""
import re
import sys

from absl import flags

_FLAG = re.compile(r"--([A-Za-z][\w-]*)(=.*)?", re.DOTALL)


def _underscored(arg: str) -> str:
    """A flag's name with underscores; anything else (a value such as "--a 1 --b 2") as is."""
    match = _FLAG.fullmatch(arg)
    if not match:
        return arg
    return "--" + match.group(1).replace("-", "_") + (match.group(2) or "")


def parse_flags(argv: list[str]) -> list[str]:
    """An `app.run(flags_parser=...)` that also takes dashed flag names. A bad flag, or an
    argument that is not one ("--port 1 2", "_port 1"), prints why and exits with 1."""
    try:
        rest = flags.FLAGS([argv[0]] + [_underscored(a) for a in argv[1:]])
        if len(rest) > 1:
            raise flags.Error(f"unexpected arguments {rest[1:]}: every option is a --flag")
    except flags.Error as e:
        sys.exit(f"FATAL Flags parsing error: {e}\nPass --helpshort or --helpfull to see help "
                 f"on flags.")
    return rest
