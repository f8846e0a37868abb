"""Host-side block plan for the ragged paged attention kernel.

Queries are cut into blocks of `q_block` tokens that never straddle sequences. For every
q block the plan lists the KV blocks some row of it can see (SPEC §4): the prefix blocks
[0, min(L, p_max + 1)) and the blocks of [a_min, p_max], i.e. of the items the q block
overlaps. Other blocks are absent: the kernel neither copies nor multiplies them.
The (q block, KV block) pairs are flattened into the kernel's 1-D grid of steps; the arrays
are padded to fixed sizes (jit shapes) and `num_steps` says how many steps are real.
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


# Block sizes by TPU kind: VMEM use stays a few MiB for head_dim 128 and 8 KV heads. On v6e
# the kernel alone would be faster at 256/256 (estimated from the compiled schedule, Qwen3-0.6B
# heads, bf16, page 16: 11 / 39 / 181 us on 10 / 64 / 256 items and 456 us on a 4k causal
# prefill, against 13 / 73 / 327 / 601 us at 128/512), but each sequence's partial q block
# pads twice as many rows, which the forward gathers and scatters around the kernel (an
# embedded-model program held 156 MB of temp, against 79 MiB at most at 128/512): 128/512
# stays until the whole forward is estimated.
# The planned XLA loop, by platform: on a GPU each step costs some 60 us of launches and a
# loop test read back by the host, whatever its size, so steps there are few and large.
_DEFAULT_BLOCKS = {"TPU v6 lite": (128, 512), "TPU v5 lite": (128, 512), "TPU v5": (128, 512),
                   "TPU v4": (128, 256), "xla cpu": (64, 128), "xla gpu": (512, 1024)}
_INTERPRET_BLOCKS = (16, 32)  # anything else runs the interpreter: keep grids small


def default_block_sizes(device_kind: str, page_size: int) -> BlockSizes:
    """`device_kind`: a TPU's, or "xla <platform>" for the planned XLA loop."""
    q_block, kv_block = _DEFAULT_BLOCKS.get(device_kind, _INTERPRET_BLOCKS)
    return BlockSizes(q_block, -(-kv_block // page_size) * page_size)


class AttentionPlan(NamedTuple):
    block_tokens: np.ndarray  # [NB, bq] packed token index of each row (0 for padding rows)
    row_pos: np.ndarray       # [NB, bq] KV position of each row (-1 for padding rows)
    row_vis: np.ndarray       # [NB, bq] visible-from a(i) of each row
    block_seq: np.ndarray     # [NB] sequence of each q block
    step_block: np.ndarray    # [NS] q block of each grid step
    step_kv: np.ndarray       # [NS] KV block (within its sequence) of each step
    step_flags: np.ndarray    # [NS] FIRST | LAST of its q block, NOOP for padding steps
    token_block: np.ndarray   # [T] q block of each packed token
    token_row: np.ndarray     # [T] row of each packed token in its q block
    num_steps: np.ndarray     # [] int32, the real steps (a dynamic grid / loop bound)


def max_plan_size(n_tokens: int, n_seqs: int, kv_len: int, sizes: BlockSizes) -> tuple[int, int]:
    """Upper bounds on (q blocks, steps) of any batch within these limits: every sequence
    may add one partial q block, and a q block visits at most all KV blocks of its sequence."""
    blocks = -(-n_tokens // sizes.q_block) + n_seqs
    return blocks, blocks * -(-kv_len // sizes.kv_block)


def visited_kv_blocks(plan: AttentionPlan) -> int:
    """KV blocks the kernel copies and multiplies (padding steps excluded)."""
    return int(np.sum((np.asarray(plan.step_flags) & NOOP) == 0))


def real_q_blocks(plan: AttentionPlan) -> int:
    """q blocks that hold a real row (padding blocks excluded)."""
    return int((np.asarray(plan.row_pos).max(axis=1) >= 0).sum())


def needed_kv_blocks(pos: np.ndarray, vis: np.ndarray, prefix_len: int, kv_block: int):
    """KV block indices some row (kv position `pos`, visible-from `vis`) can see."""
    p_max, a_min = int(pos.max()), int(vis.min())
    blocks = set(range(a_min // kv_block, p_max // kv_block + 1))
    prefix_end = min(prefix_len, p_max + 1)
    if prefix_end > 0:
        blocks |= set(range((prefix_end - 1) // kv_block + 1))
    return sorted(blocks)


def _pad(rows: list, size: int, fill, row_shape=()) -> np.ndarray:
    out = np.full((size, *row_shape), fill, np.int32)
    if rows:
        out[:len(rows)] = rows
    return out


def build_plan(cu_q_lens, kv_lens, prefix_lens, visible_from, sizes: BlockSizes,
               max_blocks: int | None = None, max_steps: int | None = None) -> AttentionPlan:
    """Pads q blocks and steps to `max_blocks` and `max_steps` (None: no padding)."""
    cu, kv_lens = np.asarray(cu_q_lens), np.asarray(kv_lens)
    visible_from, bq = np.asarray(visible_from), sizes.q_block
    n_tokens = len(visible_from)
    tokens, pos, vis, seqs, steps = [], [], [], [], []
    token_block, token_row = np.zeros(n_tokens, np.int32), np.zeros(n_tokens, np.int32)
    for s in range(len(kv_lens)):
        q_len = int(cu[s + 1] - cu[s])
        for start in range(0, q_len, bq):
            t = np.arange(cu[s] + start, cu[s] + min(start + bq, q_len))
            p = kv_lens[s] - q_len + (t - cu[s])
            kv = needed_kv_blocks(p, visible_from[t], int(prefix_lens[s]), sizes.kv_block)
            block = len(seqs)
            steps += [(block, k, FIRST * (i == 0) | LAST * (i == len(kv) - 1))
                      for i, k in enumerate(kv)]
            token_block[t], token_row[t] = block, np.arange(len(t))
            tokens.append(np.pad(t, (0, bq - len(t))))
            pos.append(np.pad(p, (0, bq - len(t)), constant_values=-1))
            vis.append(np.pad(visible_from[t], (0, bq - len(t))))
            seqs.append(s)
    n_real = len(steps)
    n_blocks = _padded_size(len(seqs), max_blocks, "q blocks")
    n_steps = _padded_size(n_real, max_steps, "steps")
    last = steps[-1] if steps else (0, 0, 0)
    steps += [(last[0], last[1], NOOP)] * (n_steps - len(steps))
    step_block, step_kv, step_flags = (np.array(c, np.int32) for c in zip(*steps))
    return AttentionPlan(
        block_tokens=_pad(tokens, n_blocks, 0, (bq,)), row_pos=_pad(pos, n_blocks, -1, (bq,)),
        row_vis=_pad(vis, n_blocks, 0, (bq,)), block_seq=_pad(seqs, n_blocks, 0),
        step_block=step_block, step_kv=step_kv, step_flags=step_flags,
        token_block=token_block, token_row=token_row, num_steps=np.int32(max(n_real, 1)))


def _padded_size(n: int, limit: int | None, what: str) -> int:
    if limit is None:
        return max(n, 1)
    if n > limit:
        raise ValueError(f"the plan has {n} {what}, more than the {limit} it is padded to")
    return limit
