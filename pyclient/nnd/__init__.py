"""nnd: look inside models held by the nnd daemon, with nnsight's syntax."""

__version__ = "0.1.0"
