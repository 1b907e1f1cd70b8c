"""The matmuls inside a Triton kernel XLA:GPU launches, read from the kernel's own IR.

A Pallas kernel reaches XLA:GPU as a `__gpu$xla.gpu.triton` custom call whose backend config
carries the kernel's Triton IR (MLIR bytecode, escaped) and its grid; the HLO shows nothing of
the matmuls inside, so a roofline read from the HLO alone sees only the kernel's bytes.
`dots(backend_config)` parses that IR (jaxlib's MLIR bindings, with its Triton dialect) and
lists every `tt.dot` of one launch as (FLOPs, operand dtype, input precision): each dot's
2 x M x N x K, times the trip counts of the `scf.for` loops around it and the grid's programs.
A loop's bounds are folded from constants (arith constants, additions, subtractions,
multiplications; a select between two, as where a program skips its loop when it has no work,
as the larger: every program counted as working, an upper bound); a loop whose bounds are
not constants (a trip count read from memory) counts once, a lower bound.
"""
import functools
import math
import re

# Private modules: jaxlib exposes its MLIR bindings and Triton dialect nowhere public; they are
# what Pallas itself builds the IR with, so they parse what it wrote.
from jax._src.lib import triton
from jax._src.lib.mlir import ir

TARGET = "__gpu$xla.gpu.triton"
_IR = re.compile(r'\bir = "((?:[^"\\]|\\[0-9A-Fa-f]{2})*)"')
_GRID = re.compile(r"\bgrid_[xyz] = (\d+)")
_ESCAPE = re.compile(rb"\\([0-9A-Fa-f]{2})")
_ARITH = {"arith.addi": lambda a, b: a + b, "arith.subi": lambda a, b: a - b,
          "arith.muli": lambda a, b: a * b}


def _unescape(text: str) -> bytes:
  """MLIR's printed string (printable ASCII as is, every other byte as \\XX) back to bytes."""
  return _ESCAPE.sub(lambda m: bytes([int(m.group(1), 16)]), text.encode("latin-1"))


def _constant(value):
  """The integer an SSA value folds to from constants, or None."""
  owner = value.owner
  op = getattr(owner, "operation", None)
  if op is None:          # a block argument (a loop counter, a kernel argument)
    return None
  if op.name == "arith.constant":
    try:
      return ir.IntegerAttr(op.attributes["value"]).value
    except (ValueError, TypeError):
      return None
  if op.name in _ARITH:
    a, b = (_constant(x) for x in op.operands)
    return None if a is None or b is None else _ARITH[op.name](a, b)
  if op.name == "arith.select":   # a program that may skip its loop: the larger branch
    branches = [_constant(x) for x in list(op.operands)[1:]]
    return None if None in branches else max(branches)
  return None


def _trips(loop) -> int:
  """An `scf.for`'s trip count from its (lower, upper, step), 1 where they are not constants."""
  lower, upper, step = (_constant(x) for x in list(loop.operands)[:3])
  if lower is None or upper is None or not step:
    return 1
  return max(math.ceil((upper - lower) / step), 0)


def _precision(dot) -> str:
  """The dot's input precision as its printed form names it (ieee, tf32, tf32x3, ...; the
  attribute itself is an enum number); Triton's default for float32 operands is tf32."""
  found = re.search(r"inputPrecision = (\w+)", str(dot))
  return found.group(1) if found else "tf32"


def _walk(op, times: int, found: list) -> None:
  for region in op.regions:
    for block in region.blocks:
      for child in block.operations:
        child = child.operation
        if child.name == "tt.dot":
          lhs = ir.RankedTensorType(child.operands[0].type)
          n = ir.RankedTensorType(child.operands[1].type).shape[-1]
          found.append((2.0 * math.prod(lhs.shape) * n * times, str(lhs.element_type),
                        _precision(child)))
        _walk(child, times * _trips(child) if child.name == "scf.for" else times, found)


def dots(backend_config: str) -> tuple:
  """((FLOPs, operand dtype, input precision), ...) of one launch of the Triton kernel whose
  backend config (the HLO custom call's `backend_config={...}` text) is given; () where it
  carries no IR."""
  found = _IR.search(backend_config)
  if not found:
    return ()
  return _launch_dots(found.group(1),
                      math.prod(int(n) for n in _GRID.findall(backend_config)))


# Keyed by what decides the count, so the launches of one kernel (its instructions differ in
# names and metadata only) parse its IR once.
@functools.lru_cache(maxsize=256)
def _launch_dots(escaped_ir: str, programs: int) -> tuple:
  with ir.Context() as ctx:
    triton.dialect.register_dialect(ctx)
    module = ir.Module.parse(_unescape(escaped_ir), ctx)
    out = []
    _walk(module.operation, programs, out)
  return tuple(out)
