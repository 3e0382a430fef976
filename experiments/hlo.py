"""Reading an optimised XLA program: what it computes, what it copies, and what is live
at its peak. Pure text processing of what XLA writes (``compiled.as_text()`` and the
``*-live-range.txt`` of ``--xla_dump_to``), so it works for any backend's program on
any machine; `experiments/compile_report.py` is its user.

* `parse_module`: computations, their instructions (result type, opcode, operands,
  attributes, ``op_name`` metadata) and their parameters' types.
* `execution_counts`: how often each computation runs per call of the program,
  through while loops (XLA's ``known_trip_count``), fusions, calls and branches.
* `matmul_flops`: 2 x M x N x K of every ``dot`` (in fusions too), cuBLAS GEMM custom
  call, ``ragged-dot`` and grouped-matmul kernel call, times its computation's count.
* `inventory`: gathers and scatters that move expert-weight-shaped arrays, dense
  expansions of ``ragged_dot``, f32 matmuls with a vocabulary-sized dimension, custom
  calls, collectives (executions per program call).
* `peak_buffers`: the buffers live at XLA's peak, each with its shape and what it is.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "token": 0,
}

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
COLLECTIVES = (
    "all-to-all",
    "ragged-all-to-all",
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "collective-permute",
)
GEMM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def bytes(self) -> float:
        return DTYPE_BYTES.get(self.dtype, 4) * math.prod(self.dims)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


def parse_type(text: str) -> list[Array]:
    """The arrays of an HLO type: one for an array type, the leaves for a tuple."""
    return [Array(d, tuple(int(x) for x in s.split(",") if x)) for d, s in _ARRAY.findall(text)]


def _tuple_elements(text: str) -> list[str]:
    """Top-level elements of a tuple type string "(a, (b, c), d)"."""
    text = _COMMENT.sub("", text).strip()
    return _split_top(text[1:-1]) if text.startswith("(") else [text]


def element_type(text: str, index: tuple[int, ...]) -> list[Array]:
    """The arrays at ``index`` (a ShapeIndex) of a type string."""
    for i in index:
        elems = _tuple_elements(text)
        if i >= len(elems):
            return []
        text = elems[i]
    return parse_type(text)


@dataclasses.dataclass
class Instr:
    name: str
    type: str
    opcode: str
    operands: list[str]
    attrs: str
    computation: str

    @property
    def arrays(self) -> list[Array]:
        return parse_type(self.type)

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""


@dataclasses.dataclass
class Computation:
    name: str
    entry: bool
    params: dict[str, str]  # name -> type
    instrs: list[Instr]

    def type_of(self, name: str) -> str:
        for i in self.instrs:
            if i.name == name:
                return i.type
        return self.params.get(name, "")


def _matching(text: str, start: int, open_ch="(", close_ch=")") -> int:
    """Index of the bracket closing the one at ``start``."""
    depth = 0
    for j in range(start, len(text)):
        if text[j] == open_ch:
            depth += 1
        elif text[j] == close_ch:
            depth -= 1
            if depth == 0:
                return j
    return len(text) - 1


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\((.*)\)\s+->\s+(.*)\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+(.*)$")


def _split_top(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def parse_module(text: str) -> dict[str, Computation]:
    """The computations of an HLO module's text, by name."""
    comps: dict[str, Computation] = {}
    cur = None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h:
            params = {}
            for p in _split_top(_COMMENT.sub("", h.group(3))):
                if ":" in p:
                    n, t = p.split(":", 1)
                    params[n.strip().lstrip("%")] = t.strip()
            cur = Computation(h.group(2), bool(h.group(1)), params, [])
            comps[cur.name] = cur
            continue
        if cur is None:
            continue
        if line.strip() == "}":
            cur = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m.group(1), m.group(2)
        if rest.startswith("("):
            end = _matching(rest, 0)
            type_str, rest = rest[: end + 1], rest[end + 1 :].lstrip()
        else:
            type_str, _, rest = rest.partition(" ")
        om = re.match(r"([\w\-]+)\(", rest)
        if not om:
            continue
        opcode = om.group(1)
        close = _matching(rest, om.end() - 1)
        operand_text = _COMMENT.sub("", rest[om.end() : close])
        operands = [o.strip().split(" ")[-1].lstrip("%") for o in _split_top(operand_text)]
        cur.instrs.append(Instr(name, type_str, opcode, operands, rest[close + 1 :], cur.name))
    return comps


def entry(comps: dict[str, Computation]) -> Computation:
    for c in comps.values():
        if c.entry:
            return c
    raise ValueError("HLO module: no ENTRY computation")


def trip_count(instr: Instr) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
    return int(m.group(1)) if m else None


def _constant(comp: Computation, name: str, depth: int = 0) -> int | None:
    """The integer value of a scalar ``constant`` instruction of ``comp`` (through
    copies and bitcasts), else None."""
    for i in comp.instrs:
        if i.name != name:
            continue
        if i.opcode == "constant":
            try:
                return int(i.operands[0])
            except (IndexError, ValueError):
                return None
        if i.opcode in ("copy", "bitcast") and i.operands and depth < 8:
            return _constant(comp, i.operands[0], depth + 1)
    return None


def inferred_trip_count(comps: dict[str, Computation], loop: Instr) -> int | None:
    """The trip count of a while loop whose backend gives none (XLA:TPU), read from its
    program: a condition ``ROOT compare(gte(param, k), constant(C)), direction=LT`` and
    an initial tuple whose element k is the constant 0; its body must add 1 to element
    k (JAX's scans and fori_loops). None when any of these is not so."""
    cond = comps.get((re.search(r"\bcondition=%?([\w.\-]+)", loop.attrs) or [None, ""])[1])
    body = comps.get((re.search(r"\bbody=%?([\w.\-]+)", loop.attrs) or [None, ""])[1])
    parent = comps.get(loop.computation)
    if not (cond and body and parent and cond.instrs):
        return None
    root = next((i for i in cond.instrs if i.opcode == "compare"), None)
    if root is None or "direction=LT" not in root.attrs or len(root.operands) != 2:
        return None
    gte = next((i for i in cond.instrs if i.name == root.operands[0]), None)
    limit = _constant(cond, root.operands[1])
    m = re.search(r"index=(\d+)", gte.attrs) if gte is not None else None
    if limit is None or gte is None or gte.opcode != "get-tuple-element" or not m:
        return None
    k = int(m.group(1))
    init = next((i for i in parent.instrs if i.name == loop.operands[0]), None)
    if init is None or init.opcode != "tuple" or k >= len(init.operands):
        return None
    if _constant(parent, init.operands[k]) != 0:
        return None
    # The body's output tuple at k: add(gte(param, k), constant(1)).
    out = next((i for i in body.instrs if i.opcode == "tuple" and "ROOT" in i.attrs), None)
    out = out or next((i for i in reversed(body.instrs) if i.opcode == "tuple"), None)
    if out is None or k >= len(out.operands):
        return None
    step = next((i for i in body.instrs if i.name == out.operands[k]), None)
    if step is None or step.opcode != "add":
        return None
    if 1 not in [_constant(body, o) for o in step.operands]:
        return None
    return limit


def _callees(instr: Instr) -> list[tuple[str, str]]:
    """(computation, role) pairs this instruction calls."""
    out = []
    for key in ("calls", "to_apply", "body", "condition", "true_computation", "false_computation"):
        for m in re.finditer(rf"\b{key}=%?([\w.\-]+)", instr.attrs):
            out.append((m.group(1), key))
    m = re.search(r"branch_computations=\{([^}]*)\}", instr.attrs)
    if m:
        out += [(b.strip().lstrip("%"), "branch") for b in m.group(1).split(",") if b.strip()]
    m = re.search(r"\bcalls=\{([^}]*)\}", instr.attrs)
    if m:
        out += [(b.strip().lstrip("%"), "calls") for b in m.group(1).split(",") if b.strip()]
    return out


def execution_counts(comps: dict[str, Computation]) -> tuple[dict[str, float], list[str]]:
    """Runs per program call of every computation reachable from the entry, and the
    while loops whose trip count XLA did not know (counted once).  One branch of a
    conditional runs per execution: each of its k branches is counted 1/k of it (the
    decode step's per-layer ``switch`` over the KV cache runs each branch once per
    layer, so the share is exact there)."""
    counts: dict[str, float] = defaultdict(float)
    unknown: list[str] = []

    def visit(name: str, n: float, depth=0):
        if name not in comps or depth > 200:
            return
        counts[name] += n
        for ins in comps[name].instrs:
            for callee, role in _callees(ins):
                mult = 1.0
                if ins.opcode == "while" and role in ("body", "condition"):
                    t = trip_count(ins)
                    if t is None:
                        t = inferred_trip_count(comps, ins)
                    if t is None:
                        unknown.append(ins.name)
                        t = 1
                    mult = t + (1 if role == "condition" else 0)
                if role == "to_apply":  # scalar reducers: not a program's work
                    continue
                if ins.opcode == "conditional":
                    mult = 1.0 / max(1, sum(1 for _, r in _callees(ins) if r != "to_apply"))
                visit(callee, n * mult, depth + 1)

    visit(entry(comps).name, 1.0)
    return dict(counts), unknown


def _operand_arrays(comp: Computation, instr: Instr, i: int) -> list[Array]:
    if i >= len(instr.operands):
        return []
    name = instr.operands[i]
    t = comp.type_of(name.split("#")[0]) if "#" not in name else ""
    if "#" in name:  # a tuple element reference name#k
        base, k = name.split("#")
        return element_type(comp.type_of(base), (int(k),))
    return parse_type(t)


def _dims_attr(attrs: str, key: str) -> list[int]:
    m = re.search(rf"{key}=\{{([0-9,]*)\}}", attrs)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def _json_dims(attrs: str, key: str) -> list[int]:
    m = re.search(rf'"{key}":\[([^\]]*)\]', attrs)
    return [int(x.strip('" ')) for x in m.group(1).split(",") if x.strip('" ')] if m else []


@dataclasses.dataclass
class Matmul:
    name: str
    computation: str
    kind: str  # dot, gemm (cuBLAS), ragged-dot, convolution, grouped (a kernel call)
    lhs: Array | None
    rhs: Array | None
    out: Array | None
    flops: float  # per execution
    count: float  # executions per program call
    op_name: str


def matmuls(comps: dict[str, Computation], counts: dict[str, float]) -> list[Matmul]:
    out = []
    for comp in comps.values():
        n = counts.get(comp.name, 0.0)
        if not n:
            continue
        for ins in comp.instrs:
            kind = None
            if ins.opcode == "dot":
                kind, lc = "dot", _dims_attr(ins.attrs, "lhs_contracting_dims")
            elif ins.opcode == "custom-call" and any(
                f'custom_call_target="{t}"' in ins.attrs for t in GEMM_CALLS
            ):
                kind, lc = "gemm", _json_dims(ins.attrs, "lhs_contracting_dimensions")
            elif ins.opcode == "ragged-dot":
                kind, lc = "ragged-dot", _dims_attr(ins.attrs, "lhs_contracting_dims")
            elif ins.opcode == "convolution":  # XLA:TPU's form of a dot
                kind, lc = "convolution", []
            elif ins.opcode == "custom-call" and re.search(r"ragged_\w*dot", ins.op_name):
                kind, lc = "grouped", []  # a grouped-matmul kernel (tokamax's Pallas)
            if kind is None:
                continue
            if kind == "grouped":
                arrays = [
                    a for i in range(len(ins.operands)) for a in _operand_arrays(comp, ins, i)
                ]
                flops = _grouped_flops(arrays + ins.arrays)
                res = (ins.arrays or [None])[0]
                out.append(
                    Matmul(ins.name, comp.name, kind, None, None, res, flops, n, ins.op_name)
                )
                continue
            lhs = (_operand_arrays(comp, ins, 0) or [None])[0]
            rhs = (_operand_arrays(comp, ins, 1) or [None])[0]
            res = (ins.arrays or [None])[0]
            k = math.prod(lhs.dims[d] for d in lc) if lhs is not None and lc else 1
            if kind == "convolution":
                # Each output element sums over the kernel's input features and window:
                # the rhs dims labelled 'i' or a digit in dim_labels=<lhs>_<rhs>-><out>.
                m = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
                if m is None or rhs is None or len(m.group(1)) != len(rhs.dims):
                    continue
                k = math.prod(n for c, n in zip(m.group(1), rhs.dims) if c == "i" or c.isdigit())
            flops = 2.0 * (math.prod(res.dims) if res else 0) * k
            out.append(Matmul(ins.name, comp.name, kind, lhs, rhs, res, flops, n, ins.op_name))
    return out


def _grouped_flops(arrays: list[Array]) -> float:
    """2 x M x X x Y for a grouped matmul among whose operands and results are one
    weight stack [G, X, Y] and row arrays [M, X] or [X, M] (the forward, the lhs
    gradient and the weight gradient alike); NaN where the shapes do not say.  M is
    every row of the operand: an upper bound where rows past the groups' sum are not
    computed (the padding to the kernel's tile; expert parallelism's receive buffer,
    ep times the rows a device sends, gspo_jax/models/expert_parallel.py)."""
    stacks = [a for a in arrays if len(a.dims) == 3]
    if len(stacks) != 1:
        return math.nan
    _, x, y = stacks[0].dims
    rows = [a for a in arrays if len(a.dims) == 2 and x in a.dims and a.dtype != "s32"]
    if not rows:
        return math.nan
    m = math.prod(rows[0].dims) // x
    return 2.0 * m * x * y


def _weight_like(a: Array, expert_shapes: list[tuple[int, int]], num_experts: int) -> bool:
    """An array of rank >= 3 whose trailing two dims are an expert matrix's and whose
    leading dim is not the expert count: a per-row or per-block copy of weights."""
    return len(a.dims) >= 3 and tuple(a.dims[-2:]) in expert_shapes and a.dims[0] != num_experts


def inventory(
    comps: dict[str, Computation],
    counts: dict[str, float],
    *,
    vocab_size: int,
    expert_shapes: list[tuple[int, int]],
    num_experts: int,
) -> dict:
    """The ops a reader of an MoE program wants to find (module docstring)."""
    weight_moves, ragged_dense, f32_vocab, custom = [], [], [], defaultdict(float)
    collectives = defaultdict(float)
    for mm in matmuls(comps, counts):
        arrays = [a for a in (mm.lhs, mm.rhs, mm.out) if a is not None]
        if "ragged_dot" in mm.op_name and mm.kind not in ("ragged-dot", "grouped"):
            ragged_dense.append(mm)
        if (
            any(vocab_size in a.dims for a in arrays)
            and mm.lhs is not None
            and mm.lhs.dtype == "f32"
            and mm.rhs is not None
            and mm.rhs.dtype == "f32"
        ):
            f32_vocab.append(mm)
    for comp in comps.values():
        n = counts.get(comp.name, 0.0)
        if not n:
            continue
        for ins in comp.instrs:
            if ins.opcode == "custom-call":
                m = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
                custom[m.group(1) if m else "?"] += n
            base = ins.opcode.removesuffix("-start")
            if base in COLLECTIVES:
                collectives[base] += n
            if ins.opcode in ("gather", "scatter"):
                res = ins.arrays
                upd = _operand_arrays(comp, ins, 2) if ins.opcode == "scatter" else []
                moved = upd if ins.opcode == "scatter" else res
                if any(_weight_like(a, expert_shapes, num_experts) for a in moved):
                    weight_moves.append(
                        dict(
                            name=ins.name,
                            opcode=ins.opcode,
                            shape=str(moved[0]),
                            bytes_per_call=sum(a.bytes for a in moved),
                            count=n,
                            op_name=ins.op_name[-120:],
                        )
                    )

    def mm_row(m: Matmul) -> dict:
        return dict(
            name=m.name,
            kind=m.kind,
            lhs=str(m.lhs),
            rhs=str(m.rhs),
            out=str(m.out),
            gflops=m.flops * m.count / 1e9,
            count=m.count,
            op_name=m.op_name[-120:],
        )

    return dict(
        expert_weight_copies=weight_moves,
        expert_weight_copy_gib=sum(w["bytes_per_call"] * w["count"] for w in weight_moves) / 2**30,
        ragged_dot_dense=[mm_row(m) for m in ragged_dense],
        f32_vocab_matmuls=[mm_row(m) for m in f32_vocab],
        custom_calls=dict(sorted(custom.items(), key=lambda kv: -kv[1])),
        collectives=dict(sorted(collectives.items(), key=lambda kv: -kv[1])),
    )


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _size(text: str) -> float:
    m = re.match(r"([0-9.]+)\s*([KMGT]?i?B)", text.strip())
    return float(m.group(1)) * _UNITS[m.group(2)] if m else 0.0


def parse_memory_usage(text: str) -> tuple[float, list[dict]]:
    """XLA's ``*-memory-usage-report.txt``: (total bytes of the program's peak, the
    slots of its heap of temporaries). A slot is a range of device memory that several values
    share at different times; each has its size, offset and the arrays it holds
    (``arrays``: [(count, Array)], tuples left out)."""
    total, slots, sections = 0.0, [], 0
    for line in text.splitlines():
        m = re.match(r"Total bytes:\s*(\d+)", line)
        if m:
            total = float(m.group(1))
            continue
        if line.strip().startswith("cumulative_size"):
            # The first table is the heap of temporaries; those after it are the
            # allocations of single arguments and outputs.
            sections += 1
            continue
        if sections != 1:
            continue
        parts = [x.strip() for x in line.split(";")]
        if len(parts) != 5 or not re.match(r"\d+$", parts[2]):
            continue
        arrays = []
        for item in _split_top(_COMMENT.sub("", parts[4])):
            if item.startswith("("):
                continue
            n = 1
            m = re.match(r"(\d+)\u00d7(.*)", item)
            if m:
                n, item = int(m.group(1)), m.group(2)
            arrays += [(n, a) for a in parse_type(item)]
        slots.append(dict(bytes=_size(parts[1]), offset=int(parts[2]), arrays=arrays))
    return total, slots


def entry_arguments(comps: dict[str, Computation]) -> list[tuple[str, Array]]:
    """The program's arguments: (parameter name, array), in parameter order. JAX names
    them after the argument's path (``state.params['embed']`` -> state_params__embed...)."""
    out = []
    for ins in entry(comps).instrs:
        if ins.opcode == "parameter":
            name = ins.name
            if re.fullmatch(r"param(\.\d+)?", name):  # unnamed: say its number
                name = f"parameter {ins.operands[0]}"
            for a in ins.arrays:
                out.append((name, a))
    return out


def peak_buffers(comps, usage_text: str, classify) -> list[dict]:
    """What the program's peak holds, largest first: its arguments (each labelled by
    ``classify(name, array, is_argument=True)``) and the slots of XLA's heap (labelled
    by their largest array, ``classify(None, array, is_argument=False)``)."""
    rows = []
    for name, arr in entry_arguments(comps):
        rows.append(
            dict(bytes=arr.bytes, shape=str(arr), what=classify(name, arr, True), name=name)
        )
    _, slots = parse_memory_usage(usage_text)
    for sl in slots:
        if not sl["arrays"]:
            continue
        values = sorted((a for _, a in sl["arrays"]), key=lambda a: -a.bytes)
        labels, firsts = [], []  # each label once, with its largest array
        for a in values:
            label = classify(None, a, False)
            if label not in labels:
                labels.append(label)
                firsts.append(str(a))
        shared = sum(n for n, _ in sl["arrays"])
        rows.append(
            dict(
                bytes=sl["bytes"],
                shape=str(values[0]),
                what=labels[0],
                also=labels[1:3],
                others=firsts[1:3],
                name=f"heap slot at {sl['offset']}" + (f" ({shared} values)" if shared > 1 else ""),
            )
        )
    return sorted(rows, key=lambda r: -r["bytes"])
