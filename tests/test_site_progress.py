"""docs/notebooks.py keeps tqdm progress bars off the site's chapter pages (a static page
shows them frozen, e.g. "quantizing (...): 0%|"), and keeps every other stderr line."""

import importlib.util
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]


def _notebooks():
    spec = importlib.util.spec_from_file_location("_site_notebooks", ROOT / "docs" / "notebooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_strip_progress_drops_bars_and_keeps_warnings():
    m = _notebooks()
    text = ("quantizing (int4-asym-g128):   0%|          | 0/8 [00:00<?, ?layer/s]\r"
            "quantizing (int4-asym-g128): 100%|##########| 8/8 [00:00<00:00, 90.33layer/s]\n"
            "UserWarning: something real\n")
    assert m.strip_progress(text) == "UserWarning: something real\n"
    assert m.strip_progress("Processed prompts: 100%|#| 3/3 [00:01<00:00, 2.1it/s]\n") == ""
    table = "50% of the values | 3 rows | fine\n"
    assert m.strip_progress(table) == table  # a pipe table is not a bar


def test_drop_widgets_removes_progress_only_stderr():
    m = _notebooks()
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stderr", text="scoring:  50%|#    | 1/2 [00:01<00:01]\n"),
        nbformat.v4.new_output("stream", name="stderr", text="a real warning\n"),
        nbformat.v4.new_output("stream", name="stdout", text="10%|x| 1/10 printed by the chapter\n"),
    ]
    nb.cells.append(cell)
    m.drop_widgets(nb)
    kinds = [(o["name"], o["text"]) for o in nb.cells[0].outputs]
    assert kinds == [("stderr", "a real warning\n"),
                     ("stdout", "10%|x| 1/10 printed by the chapter\n")]
