"""`with model.edit() as (tracer, edited):` — interventions the daemon applies to every later trace.

The block is recorded like a trace (no input) and stored on the daemon
(CreateEdit). Its id goes into every later request of the edited handle (the
copy, or the model itself with `inplace=True`); other handles, and other
clients of the same model, are never affected. A named edit (`name=`) is an
edited variant any client can open with `TransformersModel(..., edits=name)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nnd.tracing import _backends
from nnd.tracing._tracer import Tracer

if TYPE_CHECKING:
    from nnd.models._model import TransformersModel
    from nnd.tracing._cache import CacheView


class EditTracer(Tracer):
    """An edit block. Entering it gives `(tracer, edited)`, or only the
    tracer with `inplace=True`; `tracer.iter[...]` / `tracer.all()` make an
    edit apply at every selected generation step. After the block,
    `tracer.edit_id` is the stored edit's id."""

    def __init__(
        self, model: TransformersModel, *, inplace: bool = False, name: str | None = None, replace: bool = False
    ) -> None:
        self._inplace = inplace
        self.edited: TransformersModel = model if inplace else model._shallow_copy()
        """The handle the edit applies to."""
        self._store = _backends.EditBackend(self.edited, name or "", replace)
        super().__init__(model)

    def _kind(self) -> _backends.Backend:
        return self._store

    @property
    def edit_id(self) -> str:
        """The stored edit's id (its name, if it has one), once the block has ended."""
        return self._store.edit_id

    def __enter__(self) -> Any:  # type: ignore[override]
        super().__enter__()
        return self if self._inplace else (self, self.edited)

    def invoke(self, data: Any = None) -> Any:  # type: ignore[override]
        raise TypeError("an edit applies to every input of later traces; it takes no invoke")

    def _save(self, proxy: Any) -> None:
        raise ValueError("an edit cannot save: it runs in later traces, which save what they need themselves")

    def cache(self, *args: Any, **kwargs: Any) -> CacheView:
        raise ValueError("an edit cannot cache: open the cache in the trace that needs it")
