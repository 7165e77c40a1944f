"""sparsegen: `.spk` specs -> Pallas kernel modules. From Python: `sparsegen.compile(text)`
and `sparsegen.load(path)` return the generated module, imported (`sparsegen/inprocess.py`)."""


def __getattr__(name):
    # Imported on first use: `import sparsegen.formats` stays light.
    if name in ("compile", "load", "cache_dir"):
        from . import inprocess

        return getattr(inprocess, name)
    if name == "SpecError":  # what `compile` raises for a spec problem
        from .source import SpecError

        return SpecError
    raise AttributeError(f"module 'sparsegen' has no attribute {name!r}")
