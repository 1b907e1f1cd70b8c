#!/usr/bin/env bash
# One GPU, one script: installs the CUDA plugin of the pinned jax if it is missing, then runs
# the model step, train step (MFU) and decode (HBM roofline) benchmarks on a ~1B-parameter MoE
# and writes their figures to ${OUT:-runs/accelerator}/accelerator.json (benchmarks/accelerator.py).
#
#   benchmarks/accelerator.sh                  # on a machine with an NVIDIA GPU (< 8 minutes)
#   ACCEL_SMOKE=1 benchmarks/accelerator.sh    # tiny config on the CPU, no install: the logic
#   benchmarks/accelerator.sh --breakdown      # also: the model step's time per component
#   benchmarks/accelerator.sh --set=model.gdn_scan=fused   # a model setting for every part
#   benchmarks/accelerator.sh --versus=model.gdn_decode=fused   # every part again with it: ratios
#   benchmarks/accelerator.sh --versus=rollout.scan_layers=False   # an engine setting: decode alone
#   benchmarks/accelerator.sh --size=a3b_slice  # one layer cycle of 35B-A3B (300 s a part at most)
#
# PYTHON: the interpreter (default .venv/bin/python, else python3); OUT: the output folder;
# ACCEL_TIMEOUT: seconds per benchmark (decode twice; default the size's: 100 s for the 1b,
# 300 for a3b_slice); ACCEL_NO_INSTALL=1: never pip install.
#
# With the machine's own jax, where nothing can be installed (no package index): an interpreter
# whose jax already sees the GPU gets no install, whatever its version (issue 48 ran jax 0.11.2
# with its CUDA 13 plugin, not the pinned 0.10.2; the JSON records jax_version). That interpreter must also import
# the project's other dependencies; a venv that sees the machine's packages takes them from
# wheels brought along (`pip download` on a machine with the index), its jax left alone:
#
#   python3 -m venv --system-site-packages .venv-gpu          # the machine's jax + plugin
#   grep -vE '^jax(lib)?==' requirements.txt > /tmp/req.txt   # everything but jax itself
#   .venv-gpu/bin/pip install --no-index --find-links=wheels/ -r /tmp/req.txt
#   .venv-gpu/bin/pip install --no-index --find-links=wheels/ --no-deps -r requirements-nodeps.txt
#   ACCEL_NO_INSTALL=1 PYTHON=.venv-gpu/bin/python benchmarks/accelerator.sh
#
# Memory: the parent (benchmarks/accelerator.py) starts no jax backend; each benchmark process
# sets XLA_PYTHON_CLIENT_PREALLOCATE=false unless the environment sets it (allocate on demand,
# benchmarks/device_memory.py) and reports its peak from jax's memory_stats(), not nvidia-smi.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT="${OUT:-runs/accelerator}"
mkdir -p "$OUT"

if [[ -n "${ACCEL_SMOKE:-}" ]]; then
  exec "$PYTHON" benchmarks/accelerator.py --smoke --out "$OUT" --timeout "${ACCEL_TIMEOUT:-0}" "$@"
fi

if ! command -v nvidia-smi >/dev/null; then
  echo "accelerator.sh: no nvidia-smi: this script is for a machine with an NVIDIA GPU" \
       "(ACCEL_SMOKE=1 runs its tiny CPU version)" >&2
  exit 2
fi
# The plugin of exactly the pinned jax version: CUDA 13 where the driver supports it, else 12
# (jax's own extras, jax[cuda13] / jax[cuda12], pin jax-cudaNN-plugin and -pjrt to it).
JAX_VERSION="$(grep -E '^jax==' requirements.lock | cut -d= -f3)"
if ! "$PYTHON" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
  if [[ -n "${ACCEL_NO_INSTALL:-}" ]]; then
    echo "accelerator.sh: $PYTHON's jax sees no GPU and ACCEL_NO_INSTALL is set (see the" \
         "header for running with the machine's own jax)" >&2
    exit 2
  fi
  DRIVER_CUDA="$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -1)"
  if [[ "${DRIVER_CUDA:-12}" -ge 13 ]]; then CUDA=cuda13; else CUDA=cuda12; fi
  echo "installing jax[$CUDA]==$JAX_VERSION (driver CUDA ${DRIVER_CUDA:-?})"
  "$PYTHON" -m pip install --quiet "jax[$CUDA]==$JAX_VERSION"
  "$PYTHON" -c "import jax; assert jax.default_backend() == 'gpu', jax.devices(); print(jax.devices())"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PYTHON" -c "import jax; print('jax', jax.__version__)"
exec "$PYTHON" benchmarks/accelerator.py --out "$OUT" --timeout "${ACCEL_TIMEOUT:-0}" "$@"
