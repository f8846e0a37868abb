"""Multi-host serving: one tensor-parallel mesh over the devices of every host (process).

JAX runs a program over many processes only when each of them runs it. Node 0 serves HTTP and
schedules; before each forward its runner broadcasts the step (the shape bucket, then the
batch packed in one vector, model.batch.pack, whether to compute the logsumexp included) over
every process's devices, and the other nodes, which only follow, run the same program on it. A stop step, sent when node 0 closes, ends them.
"""
import dataclasses
import re

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from model.batch import ForwardBatch, pack, unpack
from runtime.batch_builder import build_batch
from runtime.buckets import BatchShape, ShapeBuckets

_STOP, _FORWARD = 0, 1


@dataclasses.dataclass(frozen=True)
class DistConfig:
    init_addr: str | None = None  # host:port of node 0's coordinator
    nnodes: int = 1
    node_rank: int = 0

    def __post_init__(self):
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in [0, --nnodes "
                             f"{self.nnodes})")
        if self.nnodes > 1 and not re.fullmatch(r"\S+:\d+", self.init_addr or ""):
            raise ValueError(f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT, got "
                             f"{self.init_addr!r}")

    def initialize(self) -> None:
        """Joins the processes (before anything touches a device); one node: nothing to do."""
        if self.nnodes > 1:
            jax.distributed.initialize(coordinator_address=self.init_addr,
                                       num_processes=self.nnodes, process_id=self.node_rank)


def agree(value: int) -> int:
    """Node 0's `value` on every node (e.g. a KV pool sized from local free memory)."""
    return int(multihost_utils.broadcast_one_to_all(np.asarray(value, np.int64)))


class StepChannel:
    """Node 0 publishes each forward's step; the other nodes receive them in the same order."""

    def __init__(self, buckets: ShapeBuckets):
        self.shapes = buckets.all_shapes()
        self._empty = {}  # shape -> the padded batch the other nodes receive into
        self._buckets = buckets

    def publish(self, shape: BatchShape, packed: np.ndarray) -> None:
        """`packed`: the batch, model.batch.pack'ed: one broadcast, not one an array."""
        self._header(_FORWARD, self.shapes.index(shape))
        multihost_utils.broadcast_one_to_all(packed)

    def stop(self) -> None:
        self._header(_STOP, 0)

    def receive(self) -> tuple[BatchShape, ForwardBatch] | None:
        """The next step, or None when node 0 stopped."""
        op, index = self._header(0, 0)
        if op == _STOP:
            return None
        shape = self.shapes[index]
        if shape not in self._empty:
            self._empty[shape] = build_batch([], [], shape, self._buckets.page_size,
                                             page_aligned=self._buckets.page_aligned)
        empty = self._empty[shape]
        return shape, unpack(multihost_utils.broadcast_one_to_all(pack(empty)), empty)

    @staticmethod
    def _header(op: int, index: int) -> list[int]:
        header = np.asarray([op, index], np.int32)
        return multihost_utils.broadcast_one_to_all(header).tolist()


def follow(runner, channel: StepChannel) -> int:
    """Runs node 0's forwards until it stops; returns how many ran."""
    steps = 0
    while (step := channel.receive()) is not None:
        shape, batch = step
        try:
            runner.run(batch, shape)
        except Exception:  # node 0 saw the same failure and answered its requests
            logging.exception("forward of a %d-token batch failed", shape.tokens)
        steps += 1
    return steps
