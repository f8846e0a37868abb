"""The TPU v6e lower bound of a piece of work, and how close a measurement came to it."""

from profiling.v6e.chip import V6E_FLOPS, V6E_INT8_OPS, V6E_HBM_PEAK_BYTES_PER_S as V6E_HBM


def _compute_s(flops: float, int8_ops: float) -> float:
    return flops / V6E_FLOPS + int8_ops / V6E_INT8_OPS


def v6e_bound_s(flops: float, hbm_bytes: float, int8_ops: float = 0.0) -> float:
    """`flops` at the bf16 rate, `int8_ops` (an int8 model's projections) at twice it."""
    return max(_compute_s(flops, int8_ops), hbm_bytes / V6E_HBM)


def roofline(flops: float, hbm_bytes: float, measured_s: float | None,
             int8_ops: float = 0.0) -> dict:
    """FLOPs (and int8 ops) and bytes of the work done, the v6e bound, and the fraction of it
    achieved by `measured_s` (on whichever device measured it)."""
    bound = v6e_bound_s(flops, hbm_bytes, int8_ops)
    compute_bound = _compute_s(flops, int8_ops) >= hbm_bytes / V6E_HBM
    return {"flops": int(flops), "int8_ops": int(int8_ops), "hbm_bytes": int(hbm_bytes),
            "v6e_roofline_s": bound, "bound_by": "compute" if compute_bound else "memory",
            "measured_s": measured_s,
            "v6e_fraction": bound / measured_s if measured_s else None}
