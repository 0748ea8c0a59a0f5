"""`import nnd` is light: no torch, no transformers, no grpc, fast."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys, time
t = time.perf_counter()
import nnd
elapsed = time.perf_counter() - t
heavy = [m for m in ("torch", "transformers", "grpc", "numpy") if m in sys.modules]
print(elapsed, ",".join(heavy))
"""


def test_import_does_not_pull_heavy_modules():
    # What it imports is the point here; how long that takes is bench/bench_import.py's (no timed asserts).
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True).stdout.split()
    assert len(out) == 1, f"import nnd imported {out[1]}"


def test_models_and_values_without_torch():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"  # an import of torch now fails
        "import nnd\n"
        "from nnd.wire import _codec, _meta\n"
        "from nnd.v1 import values_pb2\n"
        "import numpy as np\n"
        "a = _codec.Decoder().value(_codec.encode(np.arange(3, dtype=np.int64)))\n"
        "assert isinstance(a, np.ndarray), type(a)\n"
        "m = _codec.Decoder().value(values_pb2.Value(tensor=values_pb2.Tensor(dtype=1, shape=[2], meta=True)))\n"
        "assert isinstance(m, _meta.MetaTensor)\n"
        "assert repr(_meta.Size((1, 2))) == '(1, 2)'\n"
        "nnd.TransformersModel, nnd.save, nnd.LanguageModel, nnd.connect, nnd.NndError\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
