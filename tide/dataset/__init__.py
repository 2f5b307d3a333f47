"""The captured-hidden-state dataset: one Delta Lake table (ingest, reader, retention, deletion).

Names are imported lazily so the ingest service does not pay for torch (only the reader needs it).
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DatasetTable": "tide.dataset.table", "Location": "tide.dataset.location",
    "DatasetReader": "tide.dataset.reader", "Sample": "tide.dataset.reader",
    "apply_retention": "tide.dataset.retention", "delete_requests": "tide.dataset.retention",
    "Ingestor": "tide.dataset.ingest",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tide.dataset' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
