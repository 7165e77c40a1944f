"""Environment for loading jax and libtpu on a machine without a TPU.

libtpu probes for TPU hosts when it loads and prints warnings where there are none. On a
machine with no TPU device files, tell it the (unused) host layout so that it stays quiet;
ahead-of-time compiles for a topology do not depend on it. Nothing is changed where a TPU
is present, or where the variables are already set.
"""

from __future__ import annotations

import glob
import os


def tpu_device_files() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def quiet_libtpu() -> None:
    if tpu_device_files():
        return
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    # Parallel processes (test workers) may each load libtpu for AOT compiles.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def unoptimised_cpu_compiles() -> None:
    """XLA's CPU backend without its LLVM optimisations, in this process only: for programs
    compiled once and run briefly (kernels in the CPU interpreter, the TPU simulator, the
    Mosaic GPU interpreter), where compiling is most of the time: about 20% less CPU time.
    XLA reads XLA_FLAGS once per process, the first time it builds compile options (here,
    without starting any backend: a TPU stays free for the processes that run on it); the
    variable is restored after, so that processes started later (ptxas for the H200,
    libtpu's cycle estimates) see the environment they were given. libtpu's ahead-of-time
    compiles do not read the flag: their executables and memory figures are the same bytes
    with and without it (dsd_matmul for v5e, causal_attention for v6e, masked_matmul for v4,
    forward and backward). Call it before anything compiles; afterwards it changes nothing."""
    before = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = f"{before or ''} --xla_backend_optimization_level=0".strip()
    try:
        from jax._src.lib import xla_client

        xla_client.CompileOptions()  # parses XLA_FLAGS
    except (ImportError, AttributeError):  # a jax without it: compiles optimised, as before
        pass
    finally:
        if before is None:
            del os.environ["XLA_FLAGS"]
        else:
            os.environ["XLA_FLAGS"] = before


def interpreter_threads(threads: int = 8) -> None:
    """The Mosaic GPU interpreter runs each warpgroup of a CTA as a computation on XLA:CPU's
    client thread pool, `NPROC` threads (else one a core), and a barrier wait blocks its
    thread: on 2 cores a warp-specialized CTA (3 warpgroups) deadlocks once two of them wait
    for the third, which never gets a thread. Read when jax's CPU client starts: call first."""
    os.environ.setdefault("NPROC", str(max(threads, os.cpu_count() or 1)))
