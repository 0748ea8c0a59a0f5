"""The intervention engine: one executor for Scan (fake tensors on the meta model), Trace and Generate.

The worker (real weights) and the helper (the meta model) both run requests
through it; the control plane never imports it. The request loop is
`runner.py`; what a request may name is `ops.py` and `plan.py`; hooks and the
per-request executor are `hooks.py` and `executor.py`.
"""

from .interact import Interaction
from .limits import EngineLimits
from .ops import ATTRIBUTES, OPS
from .runner import MODES, run, run_session, run_worker

__all__ = ["ATTRIBUTES", "MODES", "OPS", "EngineLimits", "Interaction", "run", "run_session", "run_worker"]
