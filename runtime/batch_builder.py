"""Host-side assembly of a ForwardBatch from sequences, page tables and label ids.

Every dimension is padded to a bucket: padding tokens write nowhere (slot out of range),
padding sequences have no tokens and no KV, padding rows and labels are ignored.
"""
import numpy as np

from kernels.attention_plan import BlockSizes, build_plan
from kernels.ragged_paged_attention import AttentionMetadata
from model.batch import ForwardBatch
from runtime.buckets import bucket
from runtime.packing import Sequence

MIN_TOKENS = 16


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def _pad(values: list[int], size: int, fill: int = 0) -> np.ndarray:
    out = np.full(size, fill, np.int32)
    out[:len(values)] = values
    return out


def _slots(seq: Sequence, pages: list[int], page_size: int) -> list[int]:
    return [pages[i // page_size] * page_size + i % page_size for i in range(len(seq.tokens))]


def build_batch(seqs: list[Sequence], page_tables: list[list[int]], row_labels: list[list[int]],
                page_size: int, num_slots: int, sizes: BlockSizes | None = None
                ) -> tuple[ForwardBatch, int]:
    """Returns the padded batch and the static max new tokens per sequence.
    With block `sizes`, the attention metadata carries the Pallas kernel's block plan."""
    lens = [len(s.tokens) for s in seqs]
    n_tokens = bucket(sum(lens), MIN_TOKENS)
    n_seqs = bucket(len(seqs))
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    table = np.zeros((n_seqs, bucket(max(len(p) for p in page_tables))), np.int32)
    for i, pages in enumerate(page_tables):
        table[i, :len(pages)] = pages
    rows = [offsets[i] + r for i, s in enumerate(seqs) for r in s.score_rows]
    labels = np.zeros((bucket(len(rows)), bucket(max(map(len, row_labels)))), np.int32)
    for i, ids in enumerate(row_labels):
        labels[i, :len(ids)] = ids
    attention = AttentionMetadata(
        cu_q_lens=_pad(list(offsets), n_seqs + 1, fill=int(offsets[-1])),
        kv_lens=_pad(lens, n_seqs),
        page_indices=table,
        prefix_lens=_pad([s.prefix_len for s in seqs], n_seqs),
        visible_from=_pad([a for s in seqs for a in s.visible_from], n_tokens))
    if sizes is not None:
        plan = build_plan(attention.cu_q_lens, attention.kv_lens, attention.prefix_lens,
                          attention.visible_from, sizes, pad=bucket)
        attention = attention._replace(plan=plan)
    batch = ForwardBatch(
        tokens=_pad([t for s in seqs for t in s.tokens], n_tokens),
        positions=_pad([p for s in seqs for p in s.positions], n_tokens),
        kv_slots=_pad([x for s, p in zip(seqs, page_tables) for x in _slots(s, p, page_size)],
                      n_tokens, fill=num_slots),
        attention=attention,
        score_rows=_pad(rows, labels.shape[0]),
        label_ids=labels)
    return batch, min(bucket(max(lens), MIN_TOKENS), n_tokens)
