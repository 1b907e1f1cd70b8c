"""The matmuls and memory accesses inside a Triton kernel XLA:GPU launches, read from its own IR.

A Pallas kernel reaches XLA:GPU as a `__gpu$xla.gpu.triton` custom call whose backend config
carries the kernel's Triton IR (MLIR bytecode, escaped) and its grid; the HLO shows nothing of
the matmuls inside, so a roofline read from the HLO alone sees only the kernel's bytes.
`dots(backend_config)` parses that IR (jaxlib's MLIR bindings, with its Triton dialect) and
lists every `tt.dot` of one launch as (FLOPs, operand dtype, input precision): each dot's
2 x M x N x K, summed over the grid's programs, each program's count times the trip counts of
the `scf.for` loops around it. `arg_bytes(backend_config)` counts its memory side the same
way: the bytes each kernel argument's `tt.load`s read and its `tt.store`s write in one launch
(every tile a program loads or stores, times its loops' trip counts, summed over the grid),
each access's pointer traced back through `tt.addptr`, `tt.splat`, `tt.broadcast` and
`tt.expand_dims` to the argument it offsets. A kernel that reads part of an operand (a decode step's one layer of
a stacked state, the experts its blocks hold) then counts that part, not the operand whole.

A loop's bounds are evaluated for every program at once (numpy arrays over the grid): integer
constants, the program's ids (`tt.get_program_id`) and the integer arithmetic between them
(add, subtract, multiply, divide, remainder, min, max, compare, select, casts). Causal
attention's loops, whose lengths follow the query block a program holds, count as they run.
A select whose condition does not evaluate counts as its larger branch (an upper bound: every
program counted as working); a bound that does not evaluate at all (read from memory, or a
function of an enclosing loop's counter) counts the loop once, a lower bound. Masks and
`scf.if` are not read: an access counts as made by every program that reaches it.
"""
import functools
import math
import re

import numpy as np

# Private modules: jaxlib exposes its MLIR bindings and Triton dialect nowhere public; they are
# what Pallas itself builds the IR with, so they parse what it wrote.
from jax._src.lib import triton
from jax._src.lib.mlir import ir

TARGET = "__gpu$xla.gpu.triton"
_IR = re.compile(r'\bir = "((?:[^"\\]|\\[0-9A-Fa-f]{2})*)"')
_GRID = re.compile(r"\bgrid_([xyz]) = (\d+)")
_ESCAPE = re.compile(rb"\\([0-9A-Fa-f]{2})")


def _div_toward_zero(a, b):
  return np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))


_ARITH = {
    "arith.addi": np.add, "arith.subi": np.subtract, "arith.muli": np.multiply,
    "arith.divsi": _div_toward_zero, "arith.divui": np.floor_divide,
    "arith.floordivsi": np.floor_divide, "arith.ceildivsi": lambda a, b: -((-a) // b),
    "arith.ceildivui": lambda a, b: -((-a) // b),
    "arith.remsi": lambda a, b: a - b * _div_toward_zero(a, b), "arith.remui": np.remainder,
    "arith.minsi": np.minimum, "arith.minui": np.minimum,
    "arith.maxsi": np.maximum, "arith.maxui": np.maximum,
    "arith.andi": np.bitwise_and, "arith.ori": np.bitwise_or, "arith.xori": np.bitwise_xor,
}
_CASTS = ("arith.extsi", "arith.extui", "arith.trunci", "arith.index_cast",
          "arith.index_castui")
# arith.cmpi's predicate attribute, by number: eq, ne, slt, sle, sgt, sge, ult, ule, ugt, uge.
_COMPARE = (np.equal, np.not_equal, np.less, np.less_equal, np.greater, np.greater_equal,
            np.less, np.less_equal, np.greater, np.greater_equal)
_AXES = {"x": 0, "y": 1, "z": 2}


def _unescape(text: str) -> bytes:
  """MLIR's printed string (printable ASCII as is, every other byte as \\XX) back to bytes."""
  return _ESCAPE.sub(lambda m: bytes([int(m.group(1), 16)]), text.encode("latin-1"))


def _value(value, ids: tuple):
  """The integer(s) an SSA scalar evaluates to in each program (an array over the grid whose
  program ids are `ids`, broadcastable), or None where it does not evaluate."""
  op = getattr(value.owner, "operation", None)
  if op is None:          # a block argument (a loop counter, a kernel argument)
    return None
  if op.name == "arith.constant":
    try:
      return np.int64(ir.IntegerAttr(op.attributes["value"]).value)
    except (ValueError, TypeError):
      return None
  if op.name == "tt.get_program_id":
    return ids[_axis(op)]
  if op.name in _CASTS:
    return _value(op.operands[0], ids)
  operands = [_value(x, ids) for x in op.operands]
  if op.name == "arith.select":
    cond, a, b = operands
    if a is None or b is None:
      return None
    return np.maximum(a, b) if cond is None else np.where(cond, a, b)
  if any(x is None for x in operands):
    return None
  if op.name in _ARITH:
    return _ARITH[op.name](*operands)
  if op.name == "arith.cmpi":
    # As integers (i1: 0 or 1), which the arithmetic above may take as well.
    compare = _COMPARE[ir.IntegerAttr(op.attributes["predicate"]).value]
    return np.asarray(compare(*operands), np.int64)
  return None


def _axis(op) -> int:
  """A `tt.get_program_id`'s axis (x, y, z: 0, 1, 2), from its printed form."""
  found = re.search(r"tt\.get_program_id (\w)", str(op))
  return _AXES[found.group(1)]


def _trips(loop, ids: tuple):
  """An `scf.for`'s trip count in each program from its (lower, upper, step); 1 where they do
  not evaluate."""
  lower, upper, step = (_value(x, ids) for x in list(loop.operands)[:3])
  if lower is None or upper is None or step is None or np.any(step <= 0):
    return 1
  return np.maximum(-((lower - upper) // step), 0)


def _precision(dot) -> str:
  """The dot's input precision as its printed form names it (ieee, tf32, tf32x3, ...; the
  attribute itself is an enum number); Triton's default for float32 operands is tf32."""
  found = re.search(r"inputPrecision = (\w+)", str(dot))
  return found.group(1) if found else "tf32"


def _element_bytes(element_type):
  """Bytes of one element of an MLIR scalar type (an i1 as a byte, as Triton stores it); None
  for another type (a pointer)."""
  if isinstance(element_type, (ir.IntegerType, ir.FloatType)):   # the bindings downcast types
    return max(element_type.width, 8) / 8
  return None


def _access_bytes(value_type):
  """Bytes a load returns or a store writes: a tensor's elements, or one scalar; None where
  the element type is not a number's."""
  tensor = isinstance(value_type, ir.RankedTensorType)
  each = _element_bytes(value_type.element_type if tensor else value_type)
  if each is None:
    return None
  return math.prod(value_type.shape) * each if tensor else each


_POINTER_OPS = ("tt.addptr", "tt.splat", "tt.broadcast", "tt.expand_dims")


def _argument(pointer):
  """The number of the kernel argument a pointer (tensor) offsets, or None where it comes from
  anything but `_POINTER_OPS` from an argument of the kernel's entry block."""
  while not isinstance(pointer, ir.BlockArgument):
    op = getattr(pointer.owner, "operation", None)
    if op is None or op.name not in _POINTER_OPS:
      return None
    pointer = op.operands[0]
  owner = pointer.owner.owner    # the block's parent operation
  return pointer.arg_number if getattr(owner, "name", None) == "tt.func" else None


def _walk(op, times, ids: tuple, found: list, moved: dict) -> None:
  """Appends the dots under `op` to `found` and adds each memory access's bytes to `moved`
  ((argument number, "load" | "store") -> bytes; argument None: an access not traced to an
  argument, or of a type without a size here), each program running them `times` (array over
  the grid)."""
  for region in op.regions:
    for block in region.blocks:
      for child in block.operations:
        child = child.operation
        if child.name == "tt.dot":
          lhs = ir.RankedTensorType(child.operands[0].type)
          n = ir.RankedTensorType(child.operands[1].type).shape[-1]
          found.append((2.0 * math.prod(lhs.shape) * n * float(np.sum(times)),
                        str(lhs.element_type), _precision(child)))
        elif child.name in ("tt.load", "tt.store"):
          value = child.results[0] if child.name == "tt.load" else child.operands[1]
          size = _access_bytes(value.type)
          arg = _argument(child.operands[0]) if size is not None else None
          key = (arg, child.name[3:])
          moved[key] = moved.get(key, 0.0) + (size or 0.0) * float(np.sum(times))
        inner = times * _trips(child, ids) if child.name == "scf.for" else times
        _walk(child, inner, ids, found, moved)


def dots(backend_config: str) -> tuple:
  """((FLOPs, operand dtype, input precision), ...) of one launch of the Triton kernel whose
  backend config (the HLO custom call's `backend_config={...}` text) is given; () where it
  carries no IR."""
  launch = _launch_of(backend_config)
  return launch[0] if launch else ()


def arg_bytes(backend_config: str):
  """{(kernel argument number, "load" | "store"): bytes those accesses move in one launch} of
  the Triton kernel whose backend config is given (Pallas numbers the arguments operands
  first, then results); None where it carries no IR or an access's pointer does not trace to
  an argument."""
  launch = _launch_of(backend_config)
  if not launch or any(arg is None for (arg, _), _ in launch[1]):
    return None
  return dict(launch[1])


def _launch_of(backend_config: str):
  found = _IR.search(backend_config)
  if not found:
    return None
  sizes = dict(_GRID.findall(backend_config))
  return _launch(found.group(1), tuple(int(sizes.get(a, 1)) for a in "xyz"))


# Keyed by what decides the count, so the launches of one kernel (its instructions differ in
# names and metadata only) parse its IR once.
@functools.lru_cache(maxsize=256)
def _launch(escaped_ir: str, grid: tuple) -> tuple:
  """(dots, (((argument number, "load" | "store"), bytes), ...)) of one launch."""
  ids = tuple(np.indices(grid, dtype=np.int64))
  with ir.Context() as ctx:
    triton.dialect.register_dialect(ctx)
    module = ir.Module.parse(_unescape(escaped_ir), ctx)
    found, moved = [], {}
    _walk(module.operation, np.ones(grid, np.int64), ids, found, moved)
  return tuple(found), tuple(moved.items())
