"""model.gguf_file reads what gguf's own reader reads, in either byte order, and names a file
that is not GGUF or is cut short."""
import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from model.gguf_file import read_gguf
from model.loader import load_model

VALUES = {"u8": (250, V.UINT8), "i8": (-3, V.INT8), "u16": (65000, V.UINT16),
          "i16": (-300, V.INT16), "u32": (2**32 - 1, V.UINT32), "i32": (-70000, V.INT32),
          "f32": (0.1, V.FLOAT32), "u64": (2**64 - 1, V.UINT64), "i64": (-2**40, V.INT64),
          "f64": (0.1, V.FLOAT64), "flag": (True, V.BOOL), "name": ("héllo ▁ wörld", V.STRING)}
ARRAYS = {"ints": [3, -1, 7], "floats": [0.5, -2.25], "flags": [True, False, True],
          "words": ["a", "", "日本", "t h"]}


def write(path, endianess: gguf.GGUFEndian) -> str:
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    for key, (value, kind) in VALUES.items():
        writer.add_key_value(f"test.{key}", value, kind)
    for key, values in ARRAYS.items():
        writer.add_array(f"test.{key}", values)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("f32", w)
    writer.add_tensor("f16", w.astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for kind in (Q.Q8_0, Q.Q4_1):
        blocks = gguf.quants.quantize(w, kind)
        writer.add_tensor(kind.name, blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_and_tensor_reads_as_ggufs_reader_reads_it(tmp_path, endianess):
    path = write(tmp_path / "m.gguf", endianess)
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == want
    assert ours.byte_order == ("<" if endianess == gguf.GGUFEndian.LITTLE else ">")
    assert [type(v) for v in ours.fields.values()] == [type(v) for v in want.values()]
    assert ours.fields["test.name"] == VALUES["name"][0] and ours.fields["test.words"][2] == "日本"
    assert [t.name for t in ours.tensors] == ["f32", "f16", "i32", "Q8_0", "Q4_1"]
    for mine, read in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type) == (read.name, read.tensor_type)
        assert mine.shape == tuple(read.shape.tolist())
        assert mine.data.dtype == read.data.dtype and mine.data.shape == read.data.shape
        np.testing.assert_array_equal(mine.data, read.data)
    tensors = {t.name: t for t in ours.tensors}
    np.testing.assert_array_equal(tensors["i32"].data, np.arange(6).reshape(2, 3))
    np.testing.assert_allclose(gguf.dequantize(tensors["Q8_0"].data, Q.Q8_0),
                               tensors["f32"].data, atol=0.05)


def test_a_file_not_gguf_or_cut_short_is_named(tmp_path):
    path = write(tmp_path / "m.gguf", gguf.GGUFEndian.LITTLE)
    whole = open(path, "rb").read()
    cuts = {"empty": b"", "text": b"not a model at all", "header": whole[:60],
            "tensors": whole[:-100]}
    messages = {"empty": "is not a GGUF file", "text": "no GGUF magic",
                "header": "header ends past the file's end", "tensors": "tensor 'Q4_1' ends"}
    for name, data in cuts.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=messages[name]):
            read_gguf(str(tmp_path / name))


def test_a_big_endian_files_weights_are_refused(tmp_path):
    """Its metadata reads (above), but gguf's dequantize would read its values wrong."""
    path = write(tmp_path / "m.gguf", gguf.GGUFEndian.BIG)
    with pytest.raises(ValueError, match="big-endian GGUF file; only little-endian ones load"):
        load_model(path)
