"""Lowering for TPU on a CPU-only machine: export under an abstract TPU v6e mesh."""
import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding, use_abstract_mesh
from jax.sharding import PartitionSpec as P

V6E = AbstractDevice(device_kind="TPU v6 lite", num_cores=1, platform="tpu")


def abstract_tpu_mesh(size: int, axis: str, axis_type=AxisType.Auto) -> AbstractMesh:
    return AbstractMesh((size,), (axis,), (axis_type,), abstract_device=V6E)


def tpu_export(fn, *args) -> str:
    """The exported TPU module's MLIR text; raises if Pallas cannot lower a kernel."""
    with use_abstract_mesh(abstract_tpu_mesh(1, "x", AxisType.Explicit)):
        return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()


def tpu_export_sharded(fn, mesh: AbstractMesh, args: tuple, specs: tuple) -> jax.export.Exported:
    """`fn(*args)` exported for TPU with each arg placed on `mesh` by `specs` (a spec per arg,
    or a tree of them)."""
    def structs(spec, arg):
        sharding = NamedSharding(mesh, spec)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                            arg)

    placed = jax.tree.map(structs, specs, args, is_leaf=lambda x: isinstance(x, P))
    return jax.export.export(jax.jit(fn), platforms=["tpu"])(*placed)
