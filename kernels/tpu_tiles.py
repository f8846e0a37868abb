"""How TPU memory is tiled: the last two dims of an array in HBM or VMEM are stored in tiles of
(SUBLANES, LANES) 32-bit words. A DMA or a slice along those dims must start on a tile
boundary, and a last dim narrower than LANES takes a whole tile's width anyway."""
LANES = 128
SUBLANES = 8


def lane_aligned(n: int) -> int:
    """`n` rounded up to whole lane tiles."""
    return -(-n // LANES) * LANES
