"""What each instruction of a compiled program does, read from its optimized HLO text
(`compiled.as_text()`): the named scope it came from (`layer/qkv/dot_general`), the ops it
fuses, and the FLOPs of the dots and convolutions in it. With a listing's bundles and DMA bytes
(profiling.v6e.program_schedule) this names each fusion of the v6e estimate and gives its own
MXU bound.

FLOPs are 2 x output elements x the contracted size, for `dot` (its contracting dims) and for
`convolution` as XLA writes a dot (`dim_labels`: the lhs dims labelled `f`); a convolution
with a window is counted as its 1x1 part.
"""
import collections
import dataclasses
import functools
import re

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.-]+) .*\{\s*$")
_OPCODE = re.compile(r"^(?:\([^=]*?\)|\S+)\s+([\w-]+)\(")
_SHAPE = re.compile(r"\b(?:pred|[subf]\d+|bf16)\[([\d,]*)\]")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?(%[\w.-]+(?:, "
                    r"%[\w.-]+)*)\}?")
_SCOPE_NOISE = re.compile(r"jit\([^)]*\)/|while/body/|closed_call/|cond/branch_\d+_fun/|body/")
_PLUMBING = ("parameter", "constant", "bitcast", "tuple", "get-tuple-element")


@dataclasses.dataclass(frozen=True)
class OpFacts:
    scope: str       # the named scope of its source, e.g. "layer/mlp/dot_general"
    ops: str         # the main ops it fuses, most frequent first
    flops: float     # of the dots and convolutions it holds
    hbm_bytes: float = 0.0  # it reads and writes in HBM, by its operands' and results' layouts


_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16)\[([\d,]*)\](?:\{([^}]*)\})?")
_ITEMSIZE = {"pred": 1, "bf16": 2}
_SLICES = ("slice", "dynamic-slice", "gather")  # read what they output of their operand


def _itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype) or max(int(dtype[1:]) // 8, 1)


def array_bytes(type_text: str) -> float:
    """HBM bytes of the arrays a type names (a tuple: each), as their layouts lay them out: the
    two minor dimensions padded to the tile (T(8,128); a second tile (2,1) packs 2 rows of a
    16-bit type in one), nothing for an array in VMEM (memory space S(1))."""
    total = 0.0
    for dtype, dims_text, layout in _ARRAY.findall(type_text):
        if "S(1)" in layout:
            continue
        dims = [int(d) for d in dims_text.split(",") if d]
        order, _, tiling = layout.partition(":")
        minor = [int(d) for d in order.split(",") if d] or list(range(len(dims)))[::-1]
        tiles = [[int(t) for t in tile.split(",")]
                 for tile in re.findall(r"\(([\d,]+)\)", re.sub(r"[A-SU-Z]\(\d+\)", "", tiling))]
        if dims and tiles and len(tiles[0]) == 2:
            lanes, rows = tiles[0][1], tiles[0][0] * (tiles[1][0] if len(tiles) > 1 else 1)
            dims[minor[0]] = -(-dims[minor[0]] // lanes) * lanes
            if len(dims) > 1:
                dims[minor[1]] = -(-dims[minor[1]] // rows) * rows
        total += _product(dims) * _itemsize(dtype)
    return total


def kernel_operands_in_vmem(hlo: str) -> list[int]:
    """The bytes of each array that XLA's memory space assignment copies into VMEM (memory
    space S(1)) and hands to a Pallas call, directly or through bitcasts, in a compiled TPU
    program's HLO text; largest first."""
    sizes, handed = {}, []
    for line in hlo.splitlines():
        if not (m := _INSTRUCTION.match(line)) or not (op := _OPCODE.match(m.group(2))):
            continue
        name, text, opcode = m.group(1), m.group(2), op.group(1)
        if opcode == "copy-done" and "S(1)" in _result_type(text):
            (dtype, dims, _), = _ARRAY.findall(_result_type(text))
            sizes[name] = _product([int(d) for d in dims.split(",") if d]) * _itemsize(dtype)
        elif opcode == "bitcast" and _operands(text)[0] in sizes:
            sizes[name] = sizes[_operands(text)[0]]
        elif opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in text:
            handed += [sizes[n] for n in _operands(text) if n in sizes]
    return sorted(handed, reverse=True)


def _result_type(text: str) -> str:
    """The type an instruction's text starts with (a tuple's, in parentheses)."""
    if not text.startswith("("):
        return text.split(" ")[0]
    depth = 0
    for i, c in enumerate(text):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0:
            return text[:i + 1]
    return text


def _operands(text: str) -> list[str]:
    rest = text[len(_result_type(text)):]
    return re.findall(r"%([\w.-]+)", rest.split("(", 1)[1].split(")", 1)[0]) if "(" in rest \
        else []


def _dims(type_text: str) -> list[list[int]]:
    return [[int(x) for x in d.split(",") if x] for d in _SHAPE.findall(type_text)]


def _product(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _parse(hlo_text: str):
    """Instructions by name (their text after `=`), and each computation's instruction
    names."""
    bodies, lines, computation = collections.defaultdict(list), {}, None
    for line in hlo_text.splitlines():
        if (m := _COMPUTATION.match(line)) and "=" not in line.split("{")[0].split("(")[0]:
            computation = m.group(1)
        elif (m := _INSTRUCTION.match(line)) and computation:
            lines[m.group(1)] = m.group(2)
            bodies[computation].append(m.group(1))
    return lines, bodies


def _opcode(text: str) -> str:
    m = _OPCODE.match(text)
    return m.group(1) if m else ""


def _dot_flops(text: str, lines: dict) -> float:
    opcode, out = _opcode(text), _dims(text.split(" ")[0])
    operands = re.findall(r"%([\w.-]+)", text.split("(", 1)[1]) if "(" in text else []
    if opcode not in ("dot", "convolution") or not out or not operands:
        return 0.0
    lhs = _dims(lines.get(operands[0], "").split(" ")[0])
    if not lhs:
        return 0.0
    if opcode == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", text)
        contracted = [lhs[0][int(i)] for i in m.group(1).split(",") if i] if m else []
    else:
        m = re.search(r"dim_labels=(\w+)_", text)
        contracted = [n for label, n in zip(m.group(1), lhs[0]) if label == "f"] if m else []
    return 2.0 * _product(out[0]) * _product(contracted)


def op_facts(hlo_text: str) -> dict[str, OpFacts]:
    """Every instruction's facts, by name."""
    lines, bodies = _parse(hlo_text)

    def called(text: str) -> list[str]:
        return [c.lstrip("%") for m in _CALLS.finditer(text) for c in m.group(1).split(", ")]

    @functools.cache
    def computation_flops(computation: str) -> float:
        return sum(flops(n) for n in bodies.get(computation, ()))

    def flops(name: str) -> float:
        text = lines[name]
        return _dot_flops(text, lines) + sum(computation_flops(c) for c in called(text))

    def fused(text: str) -> str:
        inside = collections.Counter(_opcode(lines[n]) for c in called(text)
                                     for n in bodies.get(c, ()) if _opcode(lines[n])
                                     not in _PLUMBING)
        return " ".join(f"{op}x{n}" if n > 1 else op for op, n in inside.most_common(4))

    def hbm_bytes(text: str) -> float:
        """What an instruction reads and writes: its operands (where a fusion only slices or
        gathers from one, itself or in fusions nested in it, what those read of it) and
        results (where a fusion's root updates a slice in place, the update)."""
        if _opcode(text) in _SLICES:  # the rows or slice it reads, and its indices
            out = array_bytes(_result_type(text))
            return 2 * out + sum(array_bytes(_result_type(lines.get(o, "")))
                                 for o in _operands(text)[1:])
        body = next((c for c in called(text) if c in bodies), None)
        inside = {n: _operands(lines[n]) for n in bodies.get(body, ())}
        params = {int(re.search(r"parameter\((\d+)\)", lines[n]).group(1)): n
                  for n in inside if _opcode(lines[n]) == "parameter"}
        read = 0.0
        for i, operand in enumerate(_operands(text)):
            users = [n for n, uses in inside.items() if i in params and params[i] in uses]
            whole = array_bytes(_result_type(lines.get(operand, "")))
            sliced = users and all(_opcode(lines[n]) in _SLICES + ("fusion",) for n in users)
            read += (min(sum(array_bytes(_result_type(lines[n])) for n in users), whole)
                     if sliced else whole)
        root = bodies[body][-1] if body else None
        if root and _opcode(lines[root]) == "dynamic-update-slice":
            return read + array_bytes(_result_type(lines[inside[root][1]]))
        return read + array_bytes(_result_type(text))

    out = {}
    for name, text in lines.items():
        scope = re.search(r'op_name="([^"]*)"', text)
        out[name] = OpFacts(_SCOPE_NOISE.sub("", scope.group(1)) if scope else "",
                            fused(text) or _opcode(text), flops(name),
                            0.0 if _opcode(text) in _PLUMBING else hbm_bytes(text))
    return out
