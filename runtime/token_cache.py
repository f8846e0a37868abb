"""Score requests' texts not tokenized again once seen twice: a shelf of items scored against
many queries, or one query's items sent in several requests, repeats the same texts. Each
text is tokenized alone (TextTokenizer.encode_pieces), so its ids are the same wherever it
comes: the cache is exact."""
import collections
import threading

from model.tokenizer import TextTokenizer

SEEN_SLOTS = 1 << 16


def entry_bytes(text: str, ids: int) -> int:
    """About what a kept text costs: its characters, its ids as a tuple of ints, the entry."""
    return len(text) + 36 * ids + 150


class TokenCache:
    """The ids of texts seen twice, the most recently used kept up to `capacity` bytes in all
    (about: entry_bytes); a text over a 64th of that is not kept. A text is kept the second
    time it is tokenized, so that texts that come once (most queries) cost only a slot of a
    table of hashes. Safe to use from several threads."""

    def __init__(self, tokenizer: TextTokenizer, capacity: int = 64 << 20):
        self.tokenizer, self.capacity = tokenizer, capacity
        self._ids: collections.OrderedDict[str, tuple[int, ...]] = collections.OrderedDict()
        self._bytes = 0
        # a text's hash in its slot: tokenized once lately (no hash is -1 in CPython)
        self._seen = [-1] * SEEN_SLOTS
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def encode_pieces(self, texts: list[str]) -> list[list[int]]:
        """tokenizer.encode_pieces(texts): the texts not held tokenized in one call; each
        list the caller's own."""
        with self._lock:
            held = {text: self._use(text) for text in texts}
            missing = [text for text, ids in held.items() if ids is None]
            self.hits += len(texts) - len(missing)
            self.misses += len(missing)
        fresh = dict(zip(missing, self.tokenizer.encode_pieces(missing) if missing else []))
        if fresh:
            held.update(fresh)
            with self._lock:
                self._keep(fresh.items())
        out = []
        for text in texts:  # each list the caller's own: the tokenizer's handed over once
            ids = fresh.pop(text, None)
            out.append(list(held[text]) if ids is None else ids)
        return out

    def _use(self, text: str) -> tuple[int, ...] | None:
        ids = self._ids.get(text)
        if ids is not None:
            self._ids.move_to_end(text)
        return ids

    def _keep(self, fresh) -> None:
        """Keeps each (text, ids) of `fresh` seen before and not kept meanwhile; then drops
        the least recently used past the capacity."""
        for text, ids in fresh:
            key = hash(text)
            slot = key % SEEN_SLOTS
            if self._seen[slot] != key:
                self._seen[slot] = key
                continue
            size = entry_bytes(text, len(ids))
            if size <= self.capacity // 64 and text not in self._ids:
                self._ids[text] = tuple(ids)
                self._bytes += size
        while self._bytes > self.capacity:
            old, old_ids = self._ids.popitem(last=False)
            self._bytes -= entry_bytes(old, len(old_ids))
