"""A small job for the multi-process tests: joins the job the environment describes, checks the
run, gathers each process's share of range(10), sums a global array over every device, prints
one line; with `loop`, goes on running collectives until it is stopped; with `bits`, also
sums a fixed array of wide dynamic range over every device and prints its bytes' hash.

    python distributed_program.py ROOT HEARTBEAT_S [loop | bits]
"""
import hashlib
import sys
import time

sys.path.insert(0, sys.argv[1])

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from configs import tiny_cpu  # noqa: E402
from rl import distributed  # noqa: E402

config = tiny_cpu.get_config()
with config.unlocked():
  config.distributed.heartbeat_timeout_s = int(sys.argv[2])
distributed.initialize(config)
distributed.check_same_run(config)
me = jax.process_index()
gathered = distributed.gather("test/share", list(range(10))[distributed.share(10)])
mesh = Mesh(jax.devices(), ("d",))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("d")),
                                           np.full((jax.local_device_count(),), me + 1.0))
total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, PartitionSpec()))
print(f"process {me} of {jax.process_count()}: {jax.local_device_count()} of "
      f"{jax.device_count()} devices; gathered {gathered}; sum {float(total(x))}", flush=True)
if sys.argv[3:] == ["bits"]:
  rng = np.random.default_rng(0)
  wide = (rng.standard_normal((8, 4096)) * np.exp(3 * rng.standard_normal((8, 4096))))
  rows = jax.make_array_from_callback(wide.shape, NamedSharding(mesh, PartitionSpec("d")),
                                      lambda index: wide.astype(np.float32)[index])
  summed = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, PartitionSpec()))(rows)
  digest = hashlib.sha256(np.asarray(summed.addressable_data(0)).tobytes()).hexdigest()
  print(f"process {me}: bits {digest}", flush=True)
while sys.argv[3:] == ["loop"]:
  float(total(x))
  time.sleep(0.2)
