"""What a compiled GPU program does each step, read from XLA's dump of it (`--xla_dump_to`):

- launches: from the executable's launch list (`*.thunk_sequence.txt`), every kernel, library call
  and device copy, each counted as often as the loops around it run (trip counts from the optimized
  HLO, matched through `*.thunk_metadata.txt`);
- copies of weight size: buffers the program writes by copying (a `copy`, `slice`, `dynamic-slice`
  or `transpose`, alone or as a fusion's root) at least as large as the smallest layer weight matrix
  of a million elements or more (an activation as large as a weight, such as a query's transpose,
  counts too);
- copies out of a weight: the same copies, of any size, that read an array shaped as a layer's
  weight matrix or a stack of them (a per-device shard of a small weight counts, an activation not);
- float32 tensors shaped like a weight (a float32 copy of a bfloat16 weight doubles its bytes);
- the custom calls (cuBLAS, cuDNN, Pallas / Triton kernels) by target.

Only the dump is read, so this serves a program compiled for a GPU on a machine without one
(bench/gpu_compile.py) as well as one compiled on the GPU.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import math
import os
import re
import statistics

# Bytes per element of an HLO element type (sub-byte types round up per element, an upper bound).
_ELEMENT_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1,
                  "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) \(.*\) -> .*\{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9-]*)\((.*)$")
_ARRAY = re.compile(r"^([a-z0-9]+)\[([0-9,]*)\]")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply)=%([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_THUNK = re.compile(r"^(\s*)(\d+): (k\w+)")
# Thunks that hold others rather than launch anything themselves.
_CONTAINERS = {"kWhile", "kConditional", "kSequential", "kCommandBuffer", "kDynamicSliceFusion"}
_COPY_OPS = {"copy", "slice", "dynamic-slice", "transpose"}
_PASS_THROUGH = {"bitcast", "reshape", "convert", "broadcast"}  # data moved, not combined with another operand
WEIGHT_ELEMENTS = 1 << 20
_NOT_BUFFERS = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "while", "call", "conditional",
                "after-all", "partition-id", "replica-id"}


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    dtype: str | None  # None for a tuple
    dims: tuple[int, ...]
    opcode: str
    rest: str  # operands and attributes

    @property
    def nbytes(self) -> int:
        return math.prod(self.dims) * _ELEMENT_BYTES.get(self.dtype, 4) if self.dtype else 0


def parse_hlo(text: str) -> dict[str, list[Instruction]]:
    """The optimized HLO module's computations, by name, each a list of instructions; the entry
    computation under the name "ENTRY"."""
    computations: dict[str, list[Instruction]] = {}
    current = None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = computations.setdefault("ENTRY" if head.group(1) else head.group(2), [])
            continue
        m = _INSTRUCTION.match(line) if current is not None else None
        if m:
            shape = _ARRAY.match(m.group(2))
            dims = tuple(int(d) for d in shape.group(2).split(",") if d) if shape else ()
            current.append(Instruction(m.group(1), shape.group(1) if shape else None, dims, m.group(3), m.group(4)))
    return computations


@dataclasses.dataclass
class ProgramStats:
    launches: float  # a run of the program
    launches_per_layer: int  # in one trip of the layer loop, or the median unrolled layer's (0: neither)
    loops_in_layer: int  # loops inside a layer (work redone every layer, e.g. a search)
    weight_copies: int  # copies of weight size a run
    weight_copy_bytes: int
    weight_copy_ops: list[str]  # their op names (from the HLO metadata), one each
    float32_weights: list[str]  # float32 buffers shaped like a weight
    float32_weight_bytes: int  # theirs, each counted as often as it is written a run
    custom_calls: dict[str, int]  # target -> launches a run
    slice_copies: int = 0  # copies out of a weight or its stack, any size, a run
    slice_copy_ops: list[str] = dataclasses.field(default_factory=list)


def _multipliers(comps: dict[str, list[Instruction]]) -> tuple[dict[str, int], set[str], dict[str, int]]:
    """How often each computation runs in one run of the entry (loops' trip counts multiplied),
    which computations are fusion bodies (their instructions write no buffer of their own), and
    each while instruction's trip count."""
    runs: dict[str, int] = {"ENTRY": 1}
    fused: set[str] = set()
    trips: dict[str, int] = {}
    order = ["ENTRY"]
    while order:
        name = order.pop()
        for ins in comps.get(name, []):
            n = 1
            if ins.opcode == "while":
                found = _TRIPS.search(ins.rest)
                n = int(found.group(1)) if found else 1
                trips[ins.name] = n
            for kind, callee in _CALLED.findall(ins.rest):
                if ins.opcode == "fusion" and kind == "calls":
                    fused.add(callee)
                if callee not in runs:
                    runs[callee] = runs[name] * (n if kind in ("body", "condition") else 1)
                    order.append(callee)
    return runs, fused, trips


def _root(comp: list[Instruction]) -> Instruction | None:
    """A computation's result: HLO text prints the ROOT instruction last."""
    return comp[-1] if comp else None


def hlo_facts(comps: dict[str, list[Instruction]], weight_shapes: list[tuple[int, ...]]
              ) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]], list[tuple[str, int, int]]]:
    """(copies of weight size, float32 buffers shaped like a weight matrix, copies out of a weight),
    each as (op or buffer name, bytes, runs a program run), in the optimized HLO (`parse_hlo`);
    `weight_shapes` are one layer's weights (and the unstacked ones)."""
    runs, fused, _ = _multipliers(comps)
    matrices = [tuple(sorted(d for d in s if d > 1)) for s in weight_shapes]
    matrices = {m for m in matrices if len(m) >= 2}
    # Weight-sized: at least the smallest weight matrix of a million elements or more (a router's or
    # a norm's copy is not what this looks for).
    smallest = min((math.prod(m) for m in matrices if math.prod(m) >= WEIGHT_ELEMENTS), default=1 << 62)

    def weight_shaped(dims: tuple[int, ...]) -> bool:
        """A layer's weight, or a stack of them (its leading axis the layers)."""
        return any(tuple(sorted(d for d in ds if d > 1)) in matrices for ds in (dims, dims[1:]))

    copies, f32, slices = [], [], []
    for name, comp in comps.items():
        if name in fused:
            continue
        local = {i.name: i for i in comp}
        for ins in comp:
            if ins.opcode in _NOT_BUFFERS or ins.dtype is None:
                continue
            body = comps.get(_callee(ins), []) if ins.opcode == "fusion" else []
            root = _root(body)
            op = root.opcode if root is not None else ins.opcode
            found = (_op_name(root or ins, ins), ins.nbytes, runs.get(name, 1))
            if op in _COPY_OPS and math.prod(ins.dims) >= smallest:
                copies.append(found)
            source = _copied(root, body) if root is not None else _first_operand(ins, local)
            if op in _COPY_OPS and source is not None and source.dtype and weight_shaped(source.dims):
                slices.append(found)
            if ins.dtype == "f32" and tuple(sorted(d for d in ins.dims if d > 1)) in matrices:
                f32.append((f"{ins.name} f32{list(ins.dims)}", ins.nbytes, runs.get(name, 1)))
    return copies, f32, slices


def _first_operand(ins: Instruction, local: dict[str, Instruction]) -> Instruction | None:
    """An instruction's first operand (by the names printed before the closing parenthesis)."""
    names = re.findall(r"%([\w.\-]+)", ins.rest.split(")", 1)[0])
    return local.get(names[0]) if names else None


def _copied(root: Instruction, body: list[Instruction]) -> Instruction | None:
    """The fusion parameter whose data a copy-rooted fusion moves: from the root, back through copies,
    reshapes and conversions of one operand (not through arithmetic with other operands)."""
    local = {i.name: i for i in body}
    ins: Instruction | None = root
    while ins is not None and ins.opcode in _COPY_OPS | _PASS_THROUGH:
        ins = _first_operand(ins, local)
    return ins if ins is not None and ins.opcode == "parameter" else None


def _callee(ins: Instruction) -> str:
    found = re.search(r"\bcalls=%([\w.\-]+)", ins.rest)
    return found.group(1) if found else ""


def _op_name(ins: Instruction, outer: Instruction) -> str:
    """The last two parts of the op's name in the HLO metadata (what jax op made it), else its name."""
    found = re.search(r'op_name="([^"]+)"', ins.rest) or re.search(r'op_name="([^"]+)"', outer.rest)
    return "/".join(found.group(1).split("/")[-2:]) if found else outer.name


def thunk_launches(sequence: str, metadata: str, trips: dict[str, int], num_layers: int,
                   layer_of: dict[str, int] | None = None) -> tuple[float, int, int, dict[str, float]]:
    """(launches a run, launches a layer, loops inside a layer, launches by kind) from the launch list;
    a while's thunks count its trip count times (`trips`, by HLO while name). Where the layers are
    unrolled, a layer's launches are those of its name scope (`layer_of`: HLO instruction name -> its
    layer, `layer_scopes`), and the median layer's count; else a layer is a trip of the layer
    loop, the loop of `num_layers` trips that launches the most in a trip (its nested loops' launches
    apart)."""
    names = dict(re.findall(r'profile_annotation: "([^"]+)"\s*thunk_id: (\d+)', metadata))
    by_id = {int(i): n for n, i in names.items()}
    stack: list[tuple[int, int, int]] = []  # (indent of a while thunk, its trips, its thunk id)
    direct: collections.Counter = collections.Counter()  # while thunk id -> launches directly in a trip
    nested: collections.Counter = collections.Counter()  # while thunk id -> loops directly inside it
    unrolled: collections.Counter = collections.Counter()  # layer -> launches (unrolled layers)
    unrolled_loops: collections.Counter = collections.Counter()  # layer -> loops in it
    total, kinds, layer_loops = 0.0, collections.Counter(), set()
    for line in sequence.splitlines():
        m = _THUNK.match(line)
        if not m:
            continue
        indent, thunk_id, kind = len(m.group(1)), int(m.group(2)), m.group(3)
        while stack and indent <= stack[-1][0]:
            stack.pop()
        scope = (layer_of or {}).get(by_id.get(thunk_id, ""))
        if kind == "kWhile":
            n = trips.get(by_id.get(thunk_id, ""), 1)
            if stack:
                nested[stack[-1][2]] += 1
            stack.append((indent, n, thunk_id))
            if n == num_layers:
                layer_loops.add(thunk_id)
            if scope is not None:
                unrolled_loops[scope] += 1
            continue
        if kind in _CONTAINERS:
            continue
        times = math.prod(s[1] for s in stack)
        total += times
        kinds[kind] += times
        if stack:
            direct[stack[-1][2]] += 1
        if scope is not None:
            unrolled[scope] += 1
    if unrolled:  # the median layer: the first also holds what XLA hoisted out of all of them
        return total, statistics.median_high(unrolled.values()), max(unrolled_loops.values(), default=0), dict(kinds)
    layer = max(layer_loops, key=lambda i: direct[i], default=None)
    return total, direct[layer] if layer is not None else 0, nested[layer] if layer is not None else 0, dict(kinds)


_LAYER_SCOPE = re.compile(r'op_name="[^"]*/layer(\d+)/')


def layer_scopes(comps: dict[str, list[Instruction]]) -> dict[str, int]:
    """Each instruction made inside an unrolled layer (models/layers.py's `layer_loop`: the name scope
    `layer{i}` in its HLO metadata), by name -> i."""
    return {ins.name: int(m.group(1)) for comp in comps.values() for ins in comp
            if (m := _LAYER_SCOPE.search(ins.rest))}


def read_dump(dump_dir: str, weight_shapes: list[tuple[int, ...]], num_layers: int) -> ProgramStats:
    """The stats of the one module XLA dumped into `dump_dir` (its largest, where several: the step
    program rather than a helper)."""
    def one(pattern: str) -> str:
        paths = sorted(glob.glob(os.path.join(dump_dir, pattern)), key=os.path.getsize)
        if not paths:
            raise FileNotFoundError(f"no {pattern} in {dump_dir}: was the program compiled with xla_dump_to?")
        with open(paths[-1]) as f:
            return f.read()

    hlo = one("*gpu_after_optimizations.txt")
    comps = parse_hlo(hlo)
    runs, _, trips = _multipliers(comps)
    total, per_layer, loops, _ = thunk_launches(one("*.thunk_sequence.txt"), one("*.thunk_metadata.txt"), trips,
                                                num_layers, layer_scopes(comps))
    copies, f32, slices = hlo_facts(comps, weight_shapes)
    calls: collections.Counter = collections.Counter()
    for name, comp in comps.items():
        for ins in comp:
            target = _TARGET.search(ins.rest) if ins.opcode == "custom-call" else None
            if target:
                calls[target.group(1)] += runs.get(name, 1)
    return ProgramStats(total, per_layer, loops, sum(r for _, _, r in copies), sum(b * r for _, b, r in copies),
                        sorted({n for n, _, _ in copies}), sorted({n for n, _, _ in f32}),
                        sum(b * r for _, b, r in f32), dict(calls), sum(r for _, _, r in slices),
                        sorted({n for n, _, _ in slices}))
