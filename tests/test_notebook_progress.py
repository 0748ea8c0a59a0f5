"""In a real notebook (an ipykernel kernel driven by nbclient), the first trace of a META model shows
the weights loading as a tqdm bar (issue #30), and `progress=False` keeps the cell quiet."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

PROMPT = "The Eiffel Tower is in the city of"
RUN = """
import sys, nbclient, nbformat
nb = nbformat.read(sys.argv[1], as_version=4)
nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": sys.argv[2]}}).execute()
nbformat.write(nb, sys.argv[1])
"""


def _stderr(cell) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stderr")


def test_a_notebooks_first_trace_shows_a_tqdm_bar_and_progress_false_none(daemon, tiny_models, tmp_path):
    loud, quiet = str(tmp_path / "loud"), str(tmp_path / "quiet")  # checkpoints of their own: META here
    shutil.copytree(tiny_models["gpt2"], loud)
    shutil.copytree(tiny_models["gpt2"], quiet)
    trace = f"with model.trace({PROMPT!r}):\n    h = model.transformer.h[0].output.save()\nprint(tuple(h.shape))"
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(s)
        for s in (
            f"import nnd\nmodel = nnd.TransformersModel({loud!r}, address={daemon.address!r}, device='cpu')",
            trace,
            f"model = nnd.TransformersModel({quiet!r}, address={daemon.address!r}, device='cpu', progress=False)",
            trace,
        )
    ]
    # Run by nbclient in a process of its own: in a pytest process where test_notebooks.py restarted a
    # kernel, a new kernel client waits forever for replies (test_notebooks.py's note), and which files
    # share a process under `--dist loadfile` changes as tests are added.
    path = tmp_path / "progress.ipynb"
    nbformat.write(nb, str(path))
    subprocess.run([sys.executable, "-c", RUN, str(path), str(tmp_path)], check=True, timeout=600)
    nb = nbformat.read(str(path), as_version=4)
    shown = _stderr(nb.cells[1])
    assert "100%|" in shown and "tensors" in shown, shown  # tqdm's bar, not the script's lines
    assert "loading   [" not in shown, shown
    assert "weights loaded" not in _stderr(nb.cells[3]) and "100%|" not in _stderr(nb.cells[3])
