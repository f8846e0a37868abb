"""Host-side block plan for the ragged paged attention kernel.

Queries are cut into q blocks of `q_block` packed tokens, block b holding tokens
[b * q_block, (b + 1) * q_block): the kernels read q and write their output in token order,
whatever the batch's sequences. A block may hold rows of several sequences; each (q block,
sequence) segment gets a step per KV block some row of it can see (CONTRACT §4): the shared blocks
[0, min(L, p_max + 1)) and the blocks of [a_min, p_max], i.e. of the items it overlaps. A
step masks the block's rows of other sequences. Other KV blocks are absent: the kernel neither
copies nor multiplies them. The steps are padded to a fixed count (jit shapes) and
`num_steps` says how many are real.
"""
import dataclasses
from typing import NamedTuple

import numpy as np

FIRST, LAST, NOOP = 1, 2, 4  # step flags


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    q_block: int = 32    # query tokens per block
    kv_block: int = 128  # KV positions per block, a multiple of the page size

    def check(self, page_size: int) -> None:
        if self.q_block % 8 or self.kv_block % page_size:
            raise ValueError(f"{self}: q_block must be a multiple of 8 and kv_block a multiple "
                             f"of the page size {page_size}")


# Block sizes by TPU kind: VMEM use stays a few MiB for head_dim 128 and 8 KV heads. On v6e,
# 256/256 (estimated from the compiled schedule, a model): the kernel alone takes 9 / 31 / 145
# us on 10 / 64 / 256 items and 360 us on a 4k causal prefill (Qwen3-0.6B heads, bf16, page
# 16), against 11 / 47 / 185 / 357 us at 512/256 and 11 / 48 / 224 / 367 us at 256/512; the
# whole forward is as fast or faster than at 128/512 in 5 of 6 (model, bucket) pairs, at most
# 2% slower (README, "Estimated on v6e").
# The planned XLA loop, by platform: on a GPU each step costs some 60 us of launches and a
# loop test read back by the host, whatever its size, so steps there are few and large.
_DEFAULT_BLOCKS = {"TPU v6 lite": (256, 256), "TPU v5 lite": (128, 512), "TPU v5": (128, 512),
                   "TPU v4": (128, 256), "xla cpu": (64, 128), "xla gpu": (512, 1024)}
_INTERPRET_BLOCKS = (16, 32)  # anything else runs the interpreter: keep grids small


def default_block_sizes(device_kind: str, page_size: int) -> BlockSizes:
    """`device_kind`: a TPU's, or "xla <platform>" for the planned XLA loop."""
    q_block, kv_block = _DEFAULT_BLOCKS.get(device_kind, _INTERPRET_BLOCKS)
    return BlockSizes(q_block, -(-kv_block // page_size) * page_size)


class AttentionPlan(NamedTuple):
    token_pos: np.ndarray   # [T] KV position of each packed token (-1: padding)
    token_seq: np.ndarray   # [T] sequence of each packed token (-1: padding)
    step_block: np.ndarray  # [NS] q block of each grid step
    step_seq: np.ndarray    # [NS] sequence whose rows of the block the step serves
    step_kv: np.ndarray     # [NS] KV block (within its sequence) of each step
    step_flags: np.ndarray  # [NS] FIRST | LAST of its q block, NOOP for padding steps
    num_steps: np.ndarray   # [] int32, the real steps (a dynamic grid / loop bound)


def num_q_blocks(n_tokens: int, sizes: BlockSizes) -> int:
    return -(-n_tokens // sizes.q_block)


def max_plan_steps(n_tokens: int, n_seqs: int, kv_len: int, sizes: BlockSizes) -> int:
    """An upper bound on the steps of any batch within these limits: each sequence start may
    split a q block into one segment more, and a segment visits at most all KV blocks of its
    sequence."""
    segments = num_q_blocks(n_tokens, sizes) + max(n_seqs - 1, 0)
    return segments * -(-kv_len // sizes.kv_block)


def visited_kv_blocks(plan: AttentionPlan) -> int:
    """KV blocks the kernel copies and multiplies (padding steps excluded)."""
    return int(np.sum((np.asarray(plan.step_flags) & NOOP) == 0))


def real_q_blocks(plan: AttentionPlan) -> int:
    """q blocks that hold a real row (blocks of padding only have no step)."""
    real = (np.asarray(plan.step_flags) & NOOP) == 0
    return len(np.unique(np.asarray(plan.step_block)[real]))


def needed_kv_blocks(pos: np.ndarray, vis: np.ndarray, shared_len: int, kv_block: int):
    """KV block indices some row (kv position `pos`, visible-from `vis`) can see: `sees` on
    intervals. A row sees [0, min(L, pos + 1)) and [vis, pos]."""
    p_max, a_min = int(pos.max()), int(vis.min())
    blocks = set(range(a_min // kv_block, p_max // kv_block + 1))
    shared_end = min(shared_len, p_max + 1)
    if shared_end > 0:
        blocks |= set(range((shared_end - 1) // kv_block + 1))
    return sorted(blocks)


def _token_rows(cu_q_lens, kv_lens, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(KV position, sequence) of each packed token; -1 for padding tokens."""
    pos, seq = np.full(n_tokens, -1, np.int32), np.full(n_tokens, -1, np.int32)
    for s in range(len(kv_lens)):
        lo, hi = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
        pos[lo:hi] = kv_lens[s] - (hi - lo) + np.arange(hi - lo)
        seq[lo:hi] = s
    return pos, seq


def _segments(lo: int, hi: int, q_block: int):
    """Tokens [lo, hi) cut where q blocks start: (block, start, end) pieces."""
    while lo < hi:
        end = min(hi, (lo // q_block + 1) * q_block)
        yield lo // q_block, lo, end
        lo = end


def _block_flags(blocks: np.ndarray) -> np.ndarray:
    first = np.r_[True, blocks[1:] != blocks[:-1]]
    last = np.r_[blocks[1:] != blocks[:-1], True]
    return (FIRST * first | LAST * last).astype(np.int32)


def build_plan(cu_q_lens, kv_lens, shared_lens, visible_from, sizes: BlockSizes,
               max_steps: int | None = None) -> AttentionPlan:
    """Pads the steps to `max_steps` (None: no padding)."""
    cu, kv_lens, visible_from = map(np.asarray, (cu_q_lens, kv_lens, visible_from))
    pos, seq = _token_rows(cu, kv_lens, len(visible_from))
    steps = []
    for s in range(len(kv_lens)):
        for block, lo, hi in _segments(int(cu[s]), int(cu[s + 1]), sizes.q_block):
            kv = needed_kv_blocks(pos[lo:hi], visible_from[lo:hi], int(shared_lens[s]),
                                  sizes.kv_block)
            steps += [(block, s, k) for k in kv]
    n_real = len(steps)
    n_steps = _padded_size(n_real, max_steps, "steps")
    table = np.array(steps or [(0, 0, 0)], np.int32).reshape(-1, 3)
    flags = _block_flags(table[:, 0]) if steps else np.array([NOOP], np.int32)
    pad = n_steps - len(table)
    table = np.concatenate([table, np.repeat(table[-1:], pad, axis=0)])
    flags = np.concatenate([flags, np.full(pad, NOOP, np.int32)])
    return AttentionPlan(token_pos=pos, token_seq=seq, step_block=table[:, 0],
                         step_seq=table[:, 1], step_kv=table[:, 2], step_flags=flags,
                         num_steps=np.int32(max(n_real, 1)))


def _padded_size(n: int, limit: int | None, what: str) -> int:
    if limit is None:
        return max(n, 1)
    if n > limit:
        raise ValueError(f"the plan has {n} {what}, more than the {limit} it is padded to")
    return limit
