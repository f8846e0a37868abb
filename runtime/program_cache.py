"""Compiled forward programs kept on disk between starts, found without tracing them.

JAX's persistent compilation cache is keyed by the lowered program, so a start that finds every
program there still traces and lowers each one (0.17 s a program for SmolLM2 on this CPU). Here
a program is keyed by everything it is a function of: this package's source, the JAX, jaxlib
and backend versions, the XLA flags, the devices, the model config, the placed shapes of the
params and KV pool, the kernels, and the batch shape. A program found is deserialized
(jax.experimental.serialize_executable); one not found is compiled and stored, unless JAX's
cache had it (runtime.forward_programs: XLA CPU does not serialize such a program whole).
"""
import hashlib
import os
import pathlib
import pickle
import tempfile

import jax
import jaxlib
from absl import logging
from jax.experimental.serialize_executable import deserialize_and_load, serialize

_PACKAGES = ("kernels", "model", "runtime")
_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")


def source_digest() -> str:
    """sha256 of this package's Python source, file by file."""
    root, h = pathlib.Path(__file__).resolve().parent.parent, hashlib.sha256()
    for path in sorted(p for package in _PACKAGES for p in (root / package).rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


class ProgramCache:
    """A directory of compiled programs for one device group. Its entries are pickles and
    executables, run as they are: the directory must be the user's own."""

    def __init__(self, directory: str, devices: list, *parts):
        """`parts`: what every program of the group is a function of besides the devices and
        the code (configs, placed shapes), by their repr."""
        backend = devices[0].client
        self.directory, self._devices = directory, devices
        self._identity = hashlib.sha256("\n".join([
            source_digest(), jax.__version__, jaxlib.__version__, backend.platform,
            backend.platform_version, *(f"{d.device_kind} {d.id}" for d in devices),
            *(f"{name}={os.environ.get(name, '')}" for name in _ENV), *map(repr, parts),
        ]).encode()).hexdigest()

    def _path(self, program: str) -> str:
        name = hashlib.sha256((self._identity + program).encode()).hexdigest()
        return os.path.join(self.directory, name + ".program")

    def load(self, program: str):
        """The compiled program stored under `program`, or None."""
        try:
            with open(self._path(program), "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            return deserialize_and_load(payload, in_tree, out_tree, self._devices[0].client,
                                        self._devices)
        except FileNotFoundError:
            return None
        except Exception as e:  # a damaged or foreign entry: compile instead
            logging.warning("program cache: %s unreadable (%s); compiling", program, e)
            return None

    def store(self, program: str, compiled) -> None:
        """Keeps `compiled` for the next start; a directory that cannot take it is logged."""
        partial = None
        try:
            os.makedirs(self.directory, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, suffix=".partial",
                                             delete=False) as f:
                partial = f.name
                pickle.dump(serialize(compiled), f)
            os.replace(partial, self._path(program))  # whole, or not at all
        except OSError as e:
            logging.warning("program cache: cannot store %s (%s)", program, e)
            if partial and os.path.exists(partial):
                os.unlink(partial)
