"""The TPU v6e cost model the studies use, for a machine with no TPU: programs compiled for a
deviceless v6e (`compile`), their kernels' and whole programs' compiled schedules read as time
(`schedule`, `schedule_worker`, `program_schedule`), our kernels' and the whole forward's
estimates at a batch's real work (`kernel_estimates`, `forward_estimate`), the model's clock and
DMA checks (`calibrate`), and v6e's roofline (`roofline`). Every time it gives is an estimate,
not a measurement (docs/tpu_v6e.md).
"""
