"""Lowering for TPU on a CPU-only machine: export under an abstract TPU v6e mesh."""
import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh


def tpu_export(fn, *args) -> str:
    """The exported TPU module's MLIR text; raises if Pallas cannot lower a kernel."""
    dev = AbstractDevice(device_kind="TPU v6 lite", num_cores=1, platform="tpu")
    with use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=dev)):
        return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
