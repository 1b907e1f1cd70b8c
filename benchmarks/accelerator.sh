#!/usr/bin/env bash
# One GPU, one script: installs the CUDA plugin of the pinned jax if it is missing, then runs
# the model step, train step (MFU) and decode (HBM roofline) benchmarks on a ~1B-parameter MoE
# and writes their figures to ${OUT:-runs/accelerator}/accelerator.json (benchmarks/accelerator.py).
#
#   benchmarks/accelerator.sh                  # on a machine with an NVIDIA GPU (< 8 minutes)
#   ACCEL_SMOKE=1 benchmarks/accelerator.sh    # tiny config on the CPU, no install: the logic
#
# PYTHON: the interpreter (default .venv/bin/python, else python3); OUT: the output folder.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT="${OUT:-runs/accelerator}"
mkdir -p "$OUT"

if [[ -n "${ACCEL_SMOKE:-}" ]]; then
  exec "$PYTHON" benchmarks/accelerator.py --smoke --out "$OUT" --timeout "${ACCEL_TIMEOUT:-300}"
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
  DRIVER_CUDA="$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -1)"
  if [[ "${DRIVER_CUDA:-12}" -ge 13 ]]; then CUDA=cuda13; else CUDA=cuda12; fi
  echo "installing jax[$CUDA]==$JAX_VERSION (driver CUDA ${DRIVER_CUDA:-?})"
  "$PYTHON" -m pip install --quiet "jax[$CUDA]==$JAX_VERSION"
  "$PYTHON" -c "import jax; assert jax.default_backend() == 'gpu', jax.devices(); print(jax.devices())"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
exec "$PYTHON" benchmarks/accelerator.py --out "$OUT" --timeout "${ACCEL_TIMEOUT:-100}"
