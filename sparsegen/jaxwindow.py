"""The JAX versions sparsegen supports: the one statement of the window, per backend.

Generated modules state their backend's window in their header and check it when imported
(`templates/module.py.j2` calls `window_for` through the Jinja environment); pyproject.toml's
`jax` and `tpu` extras state `SUPPORTED` (both backends' windows together), the Makefile's
`test-window` runs the suite's fast subset under each `tested` version in a venv of its own,
and tests/test_jax_window.py holds them all equal to what is written here.

Why these ends (measured under each jax with the suite's fast subset):
- TPU modules: 0.11.0, tokamax's floor and vLLM-TPU's pin. Kernels, calls, gradients,
  conditions and AOT compiles through libtpu (0.0.44.1) all pass there.
- GPU modules: 0.11.2. Under 0.11.0 and 0.11.1 the Mosaic GPU interpreter cannot copy a
  block that overhangs the array's edge (a TMA copy's clipping: "could not broadcast input
  array from shape (48,64) into shape (128,64)") and 0.11.0 lowers under an abstract H200
  for the CPU (stage 2 of `sparsegen verify --target h200` fails); 0.11.0 also does not
  export `plgpu.InterpretGPUParams`.
- Below 0.13 for both: 0.12.1 is the newest jax; 0.13 may remove what 0.12 deprecates.
"""

from __future__ import annotations

from dataclasses import dataclass

from .targets import backend_of


def as_tuple(version: str) -> tuple[int, ...]:
    """A version's numeric parts, read as jax reads its own (`jax.__version_info__`):
    '0.12.0.1' -> (0, 12, 0, 1); a pre-release '0.13.0rc1' -> (0, 13)."""
    return tuple(int(p) for p in version.split(".") if p.isdigit())


@dataclass(frozen=True)
class Window:
    lowest: str  # the oldest supported jax (inclusive)
    below: str  # the first jax not supported (exclusive)
    tested: tuple[str, ...]  # the versions `make test-window` runs the fast subset under

    @property
    def requirement(self) -> str:
        """As pyproject.toml and pip write it: 'jax>=0.11.0,<0.13'."""
        return f"jax>={self.lowest},<{self.below}"

    @property
    def text(self) -> str:
        """As a person reads it: 'jax >= 0.11.0, < 0.13'."""
        return f"jax >= {self.lowest}, < {self.below}"

    @property
    def bounds(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return as_tuple(self.lowest), as_tuple(self.below)

    def supports(self, version: str) -> bool:
        low, high = self.bounds
        return low <= as_tuple(version) < high


NEWEST = "0.12.1"
WINDOWS = {
    "tpu": Window(lowest="0.11.0", below="0.13", tested=("0.11.0", NEWEST)),
    "gpu": Window(lowest="0.11.2", below="0.13", tested=("0.11.2", NEWEST)),
}
# What the package requires (pyproject.toml's extras): every backend's window together.
SUPPORTED = Window(
    lowest=min((w.lowest for w in WINDOWS.values()), key=as_tuple),
    below=max((w.below for w in WINDOWS.values()), key=as_tuple),
    tested=tuple(sorted({v for w in WINDOWS.values() for v in w.tested}, key=as_tuple)),
)


def window_for(target: str) -> Window:
    """The window of the modules built for `target` (v5e, h200, ...)."""
    return WINDOWS[backend_of(target)]
