"""Padding of jitted shapes to a few sizes, so that varied requests reuse compiled code.

Only the token count picks a bucket (`token_sizes`); every other dimension is a fixed
function of it (the attention plan's steps too, padded to the bounds of these shapes), and
work inside the model follows the real counts (the plan's real steps, the scored rows).
"""
import bisect
import dataclasses
import functools

from kernels.attention_plan import BlockSizes

MIN_TOKENS = 16
FINE_TOKENS = 256  # buckets a quarter apart from here up


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@dataclasses.dataclass(frozen=True)
class BatchShape:
    tokens: int         # new tokens
    seqs: int
    pages_per_seq: int
    rows: int           # scored rows
    labels: int         # label ids per row


@dataclasses.dataclass(frozen=True)
class ShapeBuckets:
    max_tokens: int     # new tokens in one forward
    max_seqs: int
    max_rows: int
    max_labels: int
    max_kv_len: int     # KV positions of one sequence (cached + new)
    page_size: int
    sizes: BlockSizes | None = None  # attention blocks, when the backend walks a plan
    page_aligned: bool = False  # each sequence's new tokens start on a page boundary of the
    #                             batch, padded to whole pages (runtime.batch_builder): the
    #                             TPU's k and v projection writes whole blocks of tokens

    def padded_tokens(self, new_tokens: int) -> int:
        """What a sequence's new tokens take of a batch."""
        if not self.page_aligned:
            return new_tokens
        return pages_needed(new_tokens, self.page_size) * self.page_size

    @property
    def token_budget(self) -> int:
        """The most a batch's sequences take: max_tokens of them, padded."""
        return self.padded_tokens(self.max_tokens)

    def token_sizes(self) -> tuple[int, ...]:
        """16, 24, 32, 48, ..., 192: powers of two and the halves between them; from
        FINE_TOKENS up, quarters: 256, 320, 384, 448, 512, 640, ... Padding wastes at most a
        fifth of a forward where its time follows its tokens, a third below, where fixed costs
        dominate and each bucket more is a program more to compile."""
        return self._token_sizes

    @functools.cached_property
    def _token_sizes(self) -> tuple[int, ...]:
        # every forward picks its bucket from them: made once, not once a forward
        sizes, size = [], MIN_TOKENS
        while not sizes or sizes[-1] < self.token_budget:
            steps = 4 if size >= FINE_TOKENS else 2
            sizes += [size + size * k // steps for k in range(steps)]
            size *= 2
        return tuple(s for s in sizes if s < self.token_budget) + (
            next(s for s in sizes if s >= self.token_budget),)

    def shape(self, n_tokens: int, n_rows: int = 0, n_seqs: int = 0) -> BatchShape:
        """The bucket of a batch of `n_tokens` (padded) tokens; empty items make rows
        outnumber tokens, hence the max."""
        if n_tokens > self.token_budget or n_rows > self.max_rows or n_seqs > self.max_seqs:
            raise ValueError(f"a batch of {n_tokens} tokens, {n_rows} rows and {n_seqs} "
                             f"sequences exceeds the budgets {self}")
        need = max(n_tokens, n_rows, n_seqs)
        tokens = self._token_sizes[bisect.bisect_left(self._token_sizes, need)]
        seqs, rows = min(self.max_seqs, tokens), min(self.max_rows, tokens)
        pages = pages_needed(self.max_kv_len, self.page_size)
        return BatchShape(tokens, seqs, pages, rows, self.max_labels)

    def shape_of(self, new_tokens, n_rows: int, n_seqs: int) -> BatchShape:
        """The bucket of sequences of these new tokens, each padded as a batch pads it."""
        return self.shape(sum(map(self.padded_tokens, new_tokens)), n_rows, n_seqs)

    def all_shapes(self) -> list[BatchShape]:
        return [self.shape(min(t, self.token_budget)) for t in self.token_sizes()]
