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

    out = {}
    for name, text in lines.items():
        scope = re.search(r'op_name="([^"]*)"', text)
        out[name] = OpFacts(_SCOPE_NOISE.sub("", scope.group(1)) if scope else "",
                            fused(text) or _opcode(text), flops(name))
    return out
