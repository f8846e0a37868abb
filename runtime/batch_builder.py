"""Host-side assembly of a ForwardBatch from scheduled sequences, padded to a BatchShape.

Padding pages are written nowhere (page id out of the pool), padding sequences have no tokens
and no KV, padding rows and labels are ignored. A sequence's first `cached` tokens, whole
pages, already have K/V in its pages (a prefix-cache hit): only the rest are computed, and
their K/V fill the following pages whole.
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


def _written_pages(entries: list[ScheduledSeq], offsets: np.ndarray, shape: BatchShape,
                   page_size: int, num_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """The pages the new tokens fill, and the packed token of each of their rows (a last
    page's rows past its sequence repeat the sequence's last token)."""
    pages, tokens = [], []
    for e, first in zip(entries, offsets):
        if e.cached % page_size:
            raise ValueError(f"{e.cached} cached tokens are not whole pages of {page_size}")
        n_pages = -(-e.new_tokens // page_size)
        start = e.cached // page_size
        pages += e.pages[start:start + n_pages]
        rows = np.minimum(np.arange(n_pages * page_size), e.new_tokens - 1)
        tokens.append(first + rows.reshape(n_pages, page_size))
    table = np.zeros((shape.written_pages, page_size), np.int32)
    if tokens:
        table[:len(pages)] = np.concatenate(tokens)
    return _pad(pages, shape.written_pages, fill=num_pages), table


def _attention(entries: list[ScheduledSeq], shape: BatchShape, page_size: int,
               sizes: BlockSizes | None):
    lens = [e.new_tokens for e in entries]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    table = np.zeros((shape.seqs, shape.pages_per_seq), np.int32)
    for i, e in enumerate(entries):
        table[i] = _pad(e.pages, shape.pages_per_seq)
    md = AttentionMetadata(
        cu_q_lens=_pad(offsets, shape.seqs + 1, fill=int(offsets[-1])),
        kv_lens=_pad([len(e.seq.tokens) for e in entries], shape.seqs),
        page_indices=table,
        shared_lens=_pad([e.seq.shared_len for e in entries], shape.seqs),
        visible_from=_pad([a for e in entries for a in e.seq.visible_from[e.cached:]],
                          shape.tokens))
    if sizes is None:
        return md, offsets
    plan = build_plan(md.cu_q_lens, md.kv_lens, md.shared_lens, md.visible_from, sizes,
                      shape.steps, page_size=page_size, max_item_steps=shape.item_steps)
    return md._replace(plan=plan), offsets


def build_batch(entries: list[ScheduledSeq], row_labels: list[list[int]], shape: BatchShape,
                page_size: int, num_pages: int, sizes: BlockSizes | None = None,
                with_logsumexp: bool = False) -> ForwardBatch:
    """With block `sizes`, the attention metadata carries the block plan."""
    attention, offsets = _attention(entries, shape, page_size, sizes)
    rows = [offsets[i] + r - e.cached for i, e in enumerate(entries) for r in e.seq.score_rows]
    if len(row_labels) != len(rows):
        raise ValueError(f"{len(row_labels)} label lists for {len(rows)} scored rows")
    labels = np.zeros((shape.rows, shape.labels), np.int32)
    for i, ids in enumerate(row_labels):
        labels[i] = _pad(ids, shape.labels)
    kv_pages, kv_page_tokens = _written_pages(entries, offsets, shape, page_size, num_pages)
    return ForwardBatch(
        tokens=_pad([t for e in entries for t in e.seq.tokens[e.cached:]], shape.tokens),
        positions=_pad([p for e in entries for p in e.seq.positions[e.cached:]], shape.tokens),
        kv_pages=kv_pages,
        kv_page_tokens=kv_page_tokens,
        attention=attention,
        score_rows=_pad(rows, shape.rows),
        label_ids=labels,
        num_rows=np.int32(len(rows)),
        num_labels=np.int32(max(map(len, row_labels), default=0)),
        with_logsumexp=np.bool_(with_logsumexp))
