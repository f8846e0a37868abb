"""Host-side assembly of a ForwardBatch from scheduled sequences, padded to a BatchShape.

Padding tokens write nowhere (slot out of range), padding sequences have no tokens and no
KV, padding rows and labels are ignored. A sequence's first `cached` tokens already have
K/V in its pages (a prefix-cache hit): only the rest are computed.
"""
import dataclasses

import numpy as np

from kernels.attention_plan import BlockSizes, build_plan
from kernels.ragged_paged_attention import AttentionMetadata
from model.batch import ForwardBatch
from runtime.buckets import BatchShape
from runtime.packing import Sequence


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    pages: list[int]  # page table: cached pages, then the new tokens' pages
    cached: int = 0   # leading tokens whose K/V are in the pages already

    def __post_init__(self):
        if self.cached > min(self.seq.score_rows, default=len(self.seq.tokens)):
            raise ValueError(f"{self.cached} cached tokens cover a scored row: it must be computed")

    @property
    def new_tokens(self) -> int:
        return len(self.seq.tokens) - self.cached


def _pad(values, size: int, fill: int = 0) -> np.ndarray:
    if len(values) > size:
        raise ValueError(f"{len(values)} values do not fit the padded size {size}")
    out = np.full(size, fill, np.int32)
    out[:len(values)] = values
    return out


def _slots(s: ScheduledSeq, page_size: int) -> list[int]:
    return [s.pages[i // page_size] * page_size + i % page_size
            for i in range(s.cached, len(s.seq.tokens))]


def _attention(entries: list[ScheduledSeq], shape: BatchShape, sizes: BlockSizes | None):
    lens = [e.new_tokens for e in entries]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    table = np.zeros((shape.seqs, shape.pages_per_seq), np.int32)
    for i, e in enumerate(entries):
        table[i] = _pad(e.pages, shape.pages_per_seq)
    md = AttentionMetadata(
        cu_q_lens=_pad(offsets, shape.seqs + 1, fill=int(offsets[-1])),
        kv_lens=_pad([len(e.seq.tokens) for e in entries], shape.seqs),
        page_indices=table,
        prefix_lens=_pad([e.seq.prefix_len for e in entries], shape.seqs),
        visible_from=_pad([a for e in entries for a in e.seq.visible_from[e.cached:]],
                          shape.tokens))
    if sizes is None:
        return md, offsets
    plan = build_plan(md.cu_q_lens, md.kv_lens, md.prefix_lens, md.visible_from, sizes,
                      shape.q_blocks, shape.steps)
    return md._replace(plan=plan), offsets


def build_batch(entries: list[ScheduledSeq], row_labels: list[list[int]], shape: BatchShape,
                page_size: int, num_slots: int, sizes: BlockSizes | None = None) -> ForwardBatch:
    """With block `sizes`, the attention metadata carries the block plan."""
    attention, offsets = _attention(entries, shape, sizes)
    rows = [offsets[i] + r - e.cached for i, e in enumerate(entries) for r in e.seq.score_rows]
    if len(row_labels) != len(rows):
        raise ValueError(f"{len(row_labels)} label lists for {len(rows)} scored rows")
    labels = np.zeros((shape.rows, shape.labels), np.int32)
    for i, ids in enumerate(row_labels):
        labels[i] = _pad(ids, shape.labels)
    return ForwardBatch(
        tokens=_pad([t for e in entries for t in e.seq.tokens[e.cached:]], shape.tokens),
        positions=_pad([p for e in entries for p in e.seq.positions[e.cached:]], shape.tokens),
        kv_slots=_pad([x for e in entries for x in _slots(e, page_size)], shape.tokens,
                      fill=num_slots),
        attention=attention,
        score_rows=_pad(rows, shape.rows),
        label_ids=labels,
        num_rows=np.int32(len(rows)))
