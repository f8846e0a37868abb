"""How TPU memory is tiled: the last two dims of an array in HBM or VMEM are stored in tiles of
(SUBLANES, LANES) 32-bit words. A DMA or a slice along those dims must start on a tile
boundary, and a last dim narrower than LANES takes a whole tile's width anyway."""
LANES = 128
SUBLANES = 8


def row_block(rows: int, fits, least: int = SUBLANES) -> int:
    """The largest power of two dividing `rows` that `fits` (at least `least`, a tile's
    rows), or all of them where no power of two of at least `least` divides them."""
    block = rows & -rows
    if block < least:
        return rows
    while block > least and not fits(block):
        block //= 2
    return block


def lane_aligned(n: int) -> int:
    """`n` rounded up to whole lane tiles."""
    return -(-n // LANES) * LANES
