"""The nnd daemon: control plane (control/), model workers (worker/) and the
intervention engine (engine/) they share. Needs the `daemon` extra (torch)."""

from nnd import __version__

__all__ = ["__version__"]
