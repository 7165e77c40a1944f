"""`sparsegen verify` for TPU targets, the pipeline's part: check a spec once, lower each
kernel for each target through the compiler (its rules and budgets), and hand every module
that lowered to libtpu's ahead-of-time compile (`tpu/verify.py`, which takes lowered modules
only). A kernel that does not fit a target is a failed Result there, not a compile.

GPU targets go the same way: `cli` lowers the kernels and `gpu/verify.py` takes the modules
(`verify_gpu_modules`).
"""

from __future__ import annotations

from .backends import emit_module
from .compiler import check_source, lower_for_tpu
from .shapes import default_shapes
from .source import SourceFile
from .tpu.targets import TARGETS
from .gpu import verify as gpu_verify
from .tpu import verify as tpu_verify
from .tpu.verify import Result


def verify_file(path, targets, shapes=None, nnz: float = 0.1, probe: bool = True) -> tuple[SourceFile, list[Result]]:
    """Check a spec once, then plan, budget-check and compile each kernel per target.
    A spec error raises SpecError; a kernel that does not fit a target is a failed Result."""
    return verify_file_source(SourceFile.read(path), targets, shapes, nnz, probe)


def verify_file_source(source: SourceFile, targets, shapes=None, nnz: float = 0.1, probe: bool = True) -> tuple[SourceFile, list[Result]]:
    kernels = check_source(source)
    results = []
    for kernel in kernels:
        for target in targets:
            chip = TARGETS[target]
            plan, problems = lower_for_tpu(kernel, chip)
            if problems:
                env = {**default_shapes(kernel), **(shapes or {})}
                results.append(Result(kernel.name, target, False, {s: env.get(s, lit) for s, lit in kernel.symbols}, None,
                                      plan.vmem_bytes if plan else 0, vmem_limit=chip.vmem_bytes, smem_limit=chip.smem_bytes, error=problems[0]))
                continue
            results.append(verify_plan(plan, source, target, shapes, nnz, probe))
    return source, results


def verify_plan(plan, source: SourceFile, target: str, shapes=None, nnz: float = 0.1, probe: bool = True) -> Result:
    """One lowered module's ahead-of-time compile (`tpu/verify.py`), emitted by its backend."""
    return tpu_verify.verify_plan(plan, source, target, shapes, nnz, probe, emit=emit_module)


def verify_gpu_modules(items, shapes=None, nnz: float = 0.1, stage3=True, python: str | None = None) -> list:
    """Stages 2 and 3 (`gpu/verify.py`) for each lowered (module, source, GPU target), emitted by its backend."""
    return gpu_verify.verify_modules(items, shapes, nnz, stage3, python, emit=emit_module)


def verify_gpu_module(m, source: SourceFile, target: str, shapes=None, nnz: float = 0.1, stage3: bool = True):
    return verify_gpu_modules([(m, source, target)], shapes, nnz, stage3)[0]
