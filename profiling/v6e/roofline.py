"""The TPU v6e lower bound of a piece of work, and how close a measurement came to it."""

from profiling.v6e.chip import V6E_FLOPS, V6E_HBM_PEAK_BYTES_PER_S as V6E_HBM


def v6e_bound_s(flops: float, hbm_bytes: float) -> float:
    return max(flops / V6E_FLOPS, hbm_bytes / V6E_HBM)


def roofline(flops: float, hbm_bytes: float, measured_s: float | None) -> dict:
    """FLOPs and bytes of the work done, the v6e bound, and the fraction of it achieved by
    `measured_s` (on whichever device measured it)."""
    bound = v6e_bound_s(flops, hbm_bytes)
    return {"flops": int(flops), "hbm_bytes": int(hbm_bytes), "v6e_roofline_s": bound,
            "bound_by": "compute" if flops / V6E_FLOPS >= hbm_bytes / V6E_HBM else "memory",
            "measured_s": measured_s,
            "v6e_fraction": bound / measured_s if measured_s else None}
