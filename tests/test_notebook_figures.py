"""The example notebook executes, and its figures render inline as PNG (tiny model)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_example_notebook_renders_figures(tiny_model_dir, monkeypatch):
    jupytext = pytest.importorskip("jupytext")
    nbclient = pytest.importorskip("nbclient")
    import matplotlib.image as mpimg
    import numpy as np

    nb = jupytext.read(ROOT / "examples" / "precision_toolkit.py")
    monkeypatch.setenv("MINIVLLM_EXAMPLE_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("MINIVLLM_EXAMPLE_SEQ_LEN", "48")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    pngs = [out["data"]["image/png"] for cell in nb.cells if cell.cell_type == "code"
            for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
    assert len(pngs) == 2, f"expected 2 inline figures, got {len(pngs)}"
    for data in pngs:
        img = mpimg.imread(io.BytesIO(base64.b64decode(data)), format="png")
        flat = img.reshape(-1, img.shape[-1])
        assert img.shape[0] > 100 and len(np.unique(flat, axis=0)) > 10, "blank figure"
    text = "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                   for out in cell.get("outputs", []))
    assert "first jump at layer 1 in self_attn" in text, text
