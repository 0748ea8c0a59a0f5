"""What a model's forward returns, as transformers' `ModelOutput` reads: a
dict of its fields that also answers `.logits`, `.past_key_values`..."""

from __future__ import annotations

from typing import Any


class ModelOutput(dict):  # type: ignore[type-arg]
    """A model output's fields (`out.logits`, `out["logits"]`)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"the output has no field {name!r}; it has: {', '.join(self)}") from None

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, slice)):
            # transformers orders the fields by its output class, which the wire does not carry: a
            # position could name another field than it does in-process, so it is refused, not guessed.
            raise TypeError(f"index the model output by field name ({', '.join(map(repr, self))}), not by position")
        return super().__getitem__(key)

    def __reduce__(self) -> Any:
        return (ModelOutput, (dict(self),))
