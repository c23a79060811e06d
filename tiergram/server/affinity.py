"""A core of its own for the engine's step thread (`tiergram serve --engine-core`): the step thread on one CPU, every
other thread of the server (the HTTP loop, the file placement's page-read threads) on the rest."""

from __future__ import annotations

import os

from tiergram import _native


def split_cpus() -> tuple[int, set[int]]:
    """(the step thread's CPU, the other threads' CPUs) from this process's affinity: the first CPU, the rest;
    ValueError on a machine (or affinity mask) with fewer than two CPUs or without sched_setaffinity."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("--engine-core needs sched_setaffinity (Linux)")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError(f"--engine-core needs at least 2 CPUs to split, this process may use {len(cpus)} ({cpus})")
    return cpus[0], set(cpus[1:])


def keep_off_engine_core(others: set[int]) -> None:
    """Call before the engine is built: the threads this thread starts from now on (the HTTP loop, the read threads)
    inherit `others`; the native gather pool is made first, on every CPU, since the step thread waits for it."""
    _native.num_threads()  # creates the pool now, with this thread's whole affinity
    os.sched_setaffinity(0, others)


def pin_this_thread(cpu: int) -> None:
    """Run the calling thread on `cpu` only (the step thread, as it starts)."""
    os.sched_setaffinity(0, {cpu})
