"""Memory policy and peak-memory figure of a benchmark process that has the accelerator to itself.

benchmarks/accelerator.py runs model_step.py, train_step.py and decode.py one after the other,
each as its own process; each of them, run as a program, calls `set_policy()` before it imports
jax, and puts `peak_bytes_in_use()` in its JSON line.

The policy is `XLA_PYTHON_CLIENT_PREALLOCATE=false`: the allocator grows as the program asks
instead of reserving 75% of the card at the first jax call. Chosen over a memory fraction
because the child may then use the whole card, whatever its program needs (no fraction to guess
per benchmark and size), and holds about what it uses, so what nvidia-smi shows is not just the
reserve; the allocator keeps freed blocks, so only the first steps pay for allocations. The
figure the benchmarks report is the allocator's peak of bytes in buffers, not its reserve. A variable
already set in the environment wins (setdefault): `XLA_PYTHON_CLIENT_PREALLOCATE=true
XLA_PYTHON_CLIENT_MEM_FRACTION=.9` restores a fixed reserve.
"""
import os

POLICY = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def set_policy() -> dict:
  """Sets each variable of POLICY that the environment does not set; returns those in force.

  Call before jax starts a backend (its first device, array or compile): the allocator reads
  them once, when the backend starts."""
  for key, value in POLICY.items():
    os.environ.setdefault(key, value)
  return {key: os.environ[key] for key in POLICY}


def peak_bytes_in_use():
  """The allocator's peak bytes on jax.devices()[0] since the process started; None where the
  backend keeps no statistics (the CPU's memory_stats() is None)."""
  import jax  # here, not at import: a caller sets the policy before jax loads
  stats = jax.devices()[0].memory_stats()
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  return int(stats["peak_bytes_in_use"])
