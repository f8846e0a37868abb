"""Padding of jitted shapes to a few sizes, so that varied requests reuse compiled code."""


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    size = minimum
    while size < n:
        size *= 2
    return size
