"""One TPU v6e chip as the estimate prices it: every rate and fixed cost in one place.

The MXU's peak and HBM's bandwidth are Google's published figures. The clock and the costs a
listing does not show were fitted on real v6e measurements (tokamax's autotuning cache:
profiling/v6e/data/tokamax_tpu_v6_lite.json, its "fit" half) by
`python -m profiling.v6e.against_measured --fit`; docs/tpu_v6e.md ("The estimate against a real
v6e") gives the fit, the held-out cases and the command, commit and date.
"""
import dataclasses

V6E_FLOPS = 918e12   # bf16 FLOP/s of one chip's MXUs
V6E_INT8_OPS = 2 * V6E_FLOPS  # int8 multiply-adds x 2 a second: 1,836 TOPS
V6E_HBM_PEAK_BYTES_PER_S = 1.64e12  # the roofline's; what DMAs reach: V6E.hbm_bytes_per_s


@dataclasses.dataclass(frozen=True)
class V6eCosts:
    clock_hz: float          # VLIW bundles issued a second
    hbm_bytes_per_s: float   # what DMAs between HBM and VMEM move a second
    grid_step_s: float       # a Pallas kernel's grid step, beyond its bundles and copies
    xla_op_s: float          # an XLA op (a fusion the program calls), beyond its bundles

    def overlapped(self, bundles: float, hbm_bytes: float) -> float:
        """Work whose copies overlap its compute: the larger of the two."""
        return max(bundles / self.clock_hz, hbm_bytes / self.hbm_bytes_per_s)


# Fitted on the 35 fit cases of tokamax's flash attention (its splash kernel and the program's
# transposes, compiled here with libtpu 0.0.42.1): rms relative error 3.7%; its 35 held-out
# cases read 0.93-1.08 of their measurements, median 1.00. A fixed cost for an XLA op did not
# lower the error (fitted at 0). 2026-11-28.
V6E = V6eCosts(clock_hz=1.77e9, hbm_bytes_per_s=1.46e12, grid_step_s=0.267e-6, xla_op_s=0.0)
