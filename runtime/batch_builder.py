"""Host-side assembly of a ForwardBatch from scheduled sequences, padded to a BatchShape.

Padding sequences have no tokens and no KV, padding rows and labels are ignored. In a
page-aligned batch (the TPU backends: runtime.buckets) each sequence's new tokens are padded
to whole pages, by tokens that see the shared ones and themselves, and the batch says which
page each block of page_size tokens fills (the k and v projection writes it). A sequence's
first `cached` tokens, whole pages, already have K/V in its pages (a prefix-cache hit): only
the rest are computed, and their K/V fill the following pages whole. The host sends tokens
and a few numbers a sequence; the program derives the rest from them (the attention plan,
the pages its K/V fill: kernels.attention_plan.plan_attention,
kernels.ragged_paged_attention.written_pages).
"""
import dataclasses
import itertools

import numpy as np

from kernels.ragged_paged_attention import AttentionMetadata
from model.batch import ForwardBatch
from runtime.buckets import BatchShape
from runtime.packing import Sequence, token_fields


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    pages: list[int]  # page table: cached pages, then the new tokens' pages
    cached: int = 0   # leading tokens whose K/V are in the pages already

    def __post_init__(self):
        if self.cached > self.seq.first_row:
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


def _flat(lists) -> np.ndarray:
    """Lists of ints, concatenated."""
    return np.fromiter(itertools.chain.from_iterable(lists), np.int32)


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, np.int32)


def _rows(lists, n_rows: int, width: int) -> np.ndarray:
    """Lists of ints as the leading rows of an [n_rows, width] array, zero-padded."""
    lens = np.fromiter(map(len, lists), np.int64, len(lists))
    if len(lists) > n_rows or lens.max(initial=0) > width:
        raise ValueError(f"{len(lists)} lists of up to {lens.max(initial=0)} values do not fit "
                         f"[{n_rows}, {width}]")
    out = np.zeros((n_rows, width), np.int32)
    out[:len(lists)][np.arange(width) < lens[:, None]] = _flat(lists)
    return out


def _new_tokens(entries: list[ScheduledSeq], offsets: np.ndarray, size: int) -> np.ndarray:
    """The sequences' new tokens, each at its packed offset; zeros between (the padding) and
    after."""
    out = np.zeros(size, np.int32)
    for e, start in zip(entries, offsets.tolist()):
        out[start:start + e.new_tokens] = e.seq.tokens[e.cached:]
    return out


def _padding(entries: list[ScheduledSeq], page_size: int) -> list[int]:
    """Each sequence's padding tokens, up to a whole page."""
    return [-e.new_tokens % page_size for e in entries]


def _attention(entries: list[ScheduledSeq], shape: BatchShape, page_size: int,
               pads: list[int], visible_from: np.ndarray):
    partial = [e.cached for e in entries if e.cached % page_size]
    if partial:
        raise ValueError(f"{partial[0]} cached tokens are not whole pages of {page_size}")
    lens = np.fromiter((e.new_tokens + n for e, n in zip(entries, pads)), np.int32,
                       len(entries))
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    md = AttentionMetadata(
        cu_q_lens=_pad(offsets, shape.seqs + 1, fill=int(offsets[-1])),
        kv_lens=_pad([e.cached + n for e, n in zip(entries, lens.tolist())], shape.seqs),
        page_indices=_rows([e.pages for e in entries], shape.seqs, shape.pages_per_seq),
        shared_lens=_pad([e.seq.shared_len for e in entries], shape.seqs),
        visible_from=_pad(visible_from, shape.tokens))
    return md, offsets


def _block_pages(entries: list[ScheduledSeq], shape: BatchShape, page_size: int, pads: list):
    """The page each block of page_size tokens of a page-aligned batch fills, -1 after the
    last sequence."""
    pages = [e.pages[e.cached // page_size:][:(e.new_tokens + p) // page_size]
             for e, p in zip(entries, pads)]
    return _pad(_flat(pages), shape.tokens // page_size, fill=-1)


def build_batch(entries: list[ScheduledSeq], row_labels: list[list[int]], shape: BatchShape,
                page_size: int, with_logsumexp: bool = False,
                page_aligned: bool = False) -> ForwardBatch:
    """`page_aligned`: each sequence's new tokens padded to whole pages (runtime.buckets),
    and the batch says which page each block of tokens fills."""
    pads = _padding(entries, page_size) if page_aligned else [0] * len(entries)
    positions, visible_from = token_fields([e.seq for e in entries],
                                           [e.cached for e in entries], pads)
    positions = _pad(positions, shape.tokens)  # refuses more tokens than the shape holds
    attention, offsets = _attention(entries, shape, page_size, pads, visible_from)
    rows = _joined([e.seq.score_rows + (o - e.cached) for o, e in zip(offsets.tolist(),
                                                                       entries)])
    if len(row_labels) != len(rows):
        raise ValueError(f"{len(row_labels)} label lists for {len(rows)} scored rows")
    return ForwardBatch(
        tokens=_new_tokens(entries, offsets, shape.tokens),
        positions=positions,
        attention=attention,
        score_rows=_pad(rows, shape.rows),
        label_ids=_rows(row_labels, shape.rows, shape.labels),
        num_rows=np.int32(len(rows)),
        num_labels=np.int32(max(map(len, row_labels), default=0)),
        with_logsumexp=np.bool_(with_logsumexp),
        block_pages=(_block_pages(entries, shape, page_size, pads) if page_aligned
                     else None))
