"""Where the grammar and templates live (inside the package in a wheel, beside it in a checkout),
and where sparsegen caches (`cache_dir`)."""

from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def resource_dir(kind: str) -> Path:
    """`kind` is "grammars" or "templates"."""
    for candidate in (_HERE / kind, _HERE.parent / kind):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"sparsegen is installed without its {kind}/ folder")


def read_resource(kind: str, name: str) -> str:
    return (resource_dir(kind) / name).read_text(encoding="utf-8")


def cache_dir() -> Path:
    """Where compiled modules are kept: `SPARSEGEN_CACHE_DIR`, else the user's cache folder."""
    chosen = os.environ.get("SPARSEGEN_CACHE_DIR")
    if chosen:
        return Path(chosen)
    import platformdirs

    return Path(platformdirs.user_cache_dir("sparsegen"))
