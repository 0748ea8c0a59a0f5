"""nnd: look inside models held by the nnd daemon, with nnsight's syntax.

    import nnd
    model = nnd.TransformersModel("openai-community/gpt2")
    with model.trace("The Eiffel Tower is in the city of"):
        hidden = model.transformer.h[5].output.save()

Importing nnd is cheap: grpc and the rest load when first used, torch when
the first result arrives. Results are torch tensors when torch is installed,
as nnsight's, else numpy arrays; `nnd.set_tensor_type("numpy")` (or
NND_TENSORS=numpy) asks for numpy arrays whatever is installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> (module, attribute): resolved on first access, so `import nnd` stays light.
_LAZY = {
    "TransformersModel": ("nnd.models._model", "TransformersModel"),
    "NNsight": ("nnd.models._nnsight", "NNsight"),
    "LanguageModel": ("nnd.models._model", "LanguageModel"),
    "save": ("nnd.tracing._save", "save"),
    "set_tensor_type": ("nnd.wire._torchmod", "set_tensor_type"),
    "set_progress": ("nnd.wire._progress", "set_progress"),
    "connect": ("nnd.wire.connection", "connect"),
    "Proxy": ("nnd.tracing._proxy", "Proxy"),
    "Envoy": ("nnd.models._envoy", "Envoy"),
    "MetaTensor": ("nnd.wire._meta", "MetaTensor"),
    "Size": ("nnd.wire._meta", "Size"),
    "StepToken": ("nnd.wire._results", "StepToken"),
    "CacheView": ("nnd.tracing._cache", "CacheView"),
    "Session": ("nnd.tracing._session", "Session"),
    "RemoteTokenizer": ("nnd.models._tokenizer", "RemoteTokenizer"),
    "OutsideTrace": ("nnd.tracing._usage", "OutsideTrace"),
    "ValueNotKnown": ("nnd.tracing._usage", "ValueNotKnown"),
    "NndError": ("nnd.errors", "NndError"),
    "DaemonUnavailable": ("nnd.errors", "DaemonUnavailable"),
    "ModelNotFound": ("nnd.errors", "ModelNotFound"),
    "InvalidRequest": ("nnd.errors", "InvalidRequest"),
    "WrongState": ("nnd.errors", "WrongState"),
    "LimitExceeded": ("nnd.errors", "LimitExceeded"),
    "Unauthenticated": ("nnd.errors", "Unauthenticated"),
    "Unsupported": ("nnd.errors", "Unsupported"),
    "Cancelled": ("nnd.errors", "Cancelled"),
    "DeadlineExceeded": ("nnd.errors", "DeadlineExceeded"),
    "ExportError": ("nnd.errors", "ExportError"),
    "OutOfOrderError": ("nnd.errors", "OutOfOrderError"),
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:  # static types for the lazy names (redundant aliases re-export them)
    from nnd.errors import Cancelled as Cancelled
    from nnd.errors import DaemonUnavailable as DaemonUnavailable
    from nnd.errors import DeadlineExceeded as DeadlineExceeded
    from nnd.errors import ExportError as ExportError
    from nnd.errors import InvalidRequest as InvalidRequest
    from nnd.errors import LimitExceeded as LimitExceeded
    from nnd.errors import ModelNotFound as ModelNotFound
    from nnd.errors import NndError as NndError
    from nnd.errors import OutOfOrderError as OutOfOrderError
    from nnd.errors import Unauthenticated as Unauthenticated
    from nnd.errors import Unsupported as Unsupported
    from nnd.errors import WrongState as WrongState
    from nnd.models._envoy import Envoy as Envoy
    from nnd.models._model import LanguageModel as LanguageModel
    from nnd.models._model import TransformersModel as TransformersModel
    from nnd.models._nnsight import NNsight as NNsight
    from nnd.models._tokenizer import RemoteTokenizer as RemoteTokenizer
    from nnd.tracing._cache import CacheView as CacheView
    from nnd.tracing._proxy import Proxy as Proxy
    from nnd.tracing._save import save as save
    from nnd.tracing._session import Session as Session
    from nnd.tracing._usage import OutsideTrace as OutsideTrace
    from nnd.tracing._usage import ValueNotKnown as ValueNotKnown
    from nnd.wire._meta import MetaTensor as MetaTensor
    from nnd.wire._meta import Size as Size
    from nnd.wire._results import StepToken as StepToken
    from nnd.wire._torchmod import set_tensor_type as set_tensor_type
    from nnd.wire.connection import connect as connect


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'nnd' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
