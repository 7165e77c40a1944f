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


def interpreter_threads(threads: int = 8) -> None:
    """The Mosaic GPU interpreter runs each warpgroup of a CTA as a computation on XLA:CPU's
    client thread pool, `NPROC` threads (else one a core), and a barrier wait blocks its
    thread: on 2 cores a warp-specialized CTA (3 warpgroups) deadlocks once two of them wait
    for the third, which never gets a thread. Read when jax's CPU client starts: call first."""
    os.environ.setdefault("NPROC", str(max(threads, os.cpu_count() or 1)))
