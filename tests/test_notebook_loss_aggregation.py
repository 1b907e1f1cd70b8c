"""notebooks/loss_aggregation.ipynb runs headless (fast mode: few trajectories, no RL jobs)."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_loss_aggregation_notebook_executes(monkeypatch):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  pytest.importorskip("ipykernel")
  monkeypatch.setenv("NB_FAST", "1")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  monkeypatch.delenv("XLA_FLAGS", raising=False)  # one CPU device is all the notebook needs
  nb = nbformat.read(os.path.join(ROOT, "notebooks", "loss_aggregation.ipynb"), as_version=4)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}})
  client.execute()
  outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                    for o in c.get("outputs", []))
  assert "prompt_mean" in outputs and "weight per prompt group" in outputs
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors, errors
