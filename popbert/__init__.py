"""popbert: pre-train and fine-tune BERT-family models from an annotated ONNX graph.

The public face: `load_config` (or `finetune_config`) → `Trainer.from_config(cfg)` → `train()` is
a whole run. Underneath,
in the order one batch travels: `build_bert` (or your own graph with `Builder` / `TensorInfo`)
→ a `Session` (`make_session`, or `TrainingSession` with `SessionOptions`) → checkpoints →
`InferenceSession` or the ONNX export.

Names are imported on first use (PEP 562), so `import popbert` and the CLI's error paths stay
fast: torch is loaded only when a session or a model is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "Builder": "popbert.graph.builder",
    "TensorInfo": "popbert.graph.builder",
    "build_bert": "popbert.builders.bert",
    "BertConfig": "popbert.builders.bert_config",
    "load_config": "popbert.config",
    "RunConfig": "popbert.config",
    "TrainingSession": "popbert.runtime.session",
    "InferenceSession": "popbert.runtime.session",
    "SessionOptions": "popbert.runtime.options",
    "Session": "popbert.runtime.protocol",
    "make_session": "popbert.backends.sessions",
    "Trainer": "popbert.train.trainer",
    "RunResult": "popbert.train.trainer",
    "PopbertError": "popbert.errors",
    "finetune_config": "popbert.train.finetune",
}

__all__ = ["BertConfig", "Builder", "InferenceSession", "PopbertError", "RunConfig", "RunResult",
           "Session", "SessionOptions", "TensorInfo", "Trainer", "TrainingSession", "__version__",
           "build_bert", "finetune_config", "load_config", "make_session"]

if TYPE_CHECKING:
    from popbert.backends.sessions import make_session
    from popbert.builders.bert import build_bert
    from popbert.builders.bert_config import BertConfig
    from popbert.config import RunConfig, load_config
    from popbert.errors import PopbertError
    from popbert.graph.builder import Builder, TensorInfo
    from popbert.runtime.options import SessionOptions
    from popbert.runtime.protocol import Session
    from popbert.runtime.session import InferenceSession, TrainingSession
    from popbert.train.finetune import finetune_config
    from popbert.train.trainer import RunResult, Trainer


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'popbert' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
