"""CPUs for the evaluation's processes on one host: the action servers it starts on a few CPUs of their own, the env
workers on the rest (`server.reserve_cpus`, docs/evaluation.md); or the env workers at a higher niceness
(`env_nice`), so that a server's or the evaluation's own thread that wakes up for a short piece of host work takes a
CPU from a simulator at once instead of waiting out its time slice, while the simulators keep every CPU otherwise.

Why: with every core simulating, a server's host work per batch (decoding, stacking, the launch of the model call)
competes with the simulators for CPU time, and every env waits for that request. Linux only
(`os.sched_setaffinity`); a process's every thread is pinned, and threads it starts later inherit the set.

A process pinned while it runs keeps the OpenMP team it sized at start: GNU OpenMP (torch's CPU ops) spin-waits
at every parallel region while the team fits the CPUs it saw then, so four threads squeezed onto two CPUs spin
against each other. Measured: 8782.5 -> 1566.9 env steps/s at 32 envs on the GPU machine (the server's compute
150 against 19.6 ms a batch, session 17), and 18 ms -> 6.4 s for 600 small torch ops on this machine's bench
(bench/bench_omp_pin.py). So a process that may be pinned starts with PINNABLE_ENV (its threads sleep at once
instead of spinning), and its torch threads never outnumber its CPUs (torch_threads)."""

from __future__ import annotations

import os

from wamkit.core.errors import UserError


def usable_cpus() -> list[int]:
    """The CPUs this process may run on, ascending."""
    return sorted(os.sched_getaffinity(0))


PINNABLE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def pinnable_env(environ: dict[str, str]) -> dict[str, str]:
    """`environ` with PINNABLE_ENV added where it does not set those variables itself (a user's choice wins)."""
    return {**PINNABLE_ENV, **environ}


def torch_threads(configured: int = 0, most: int = 4) -> int:
    """Torch intra-op threads of a process: `configured` if > 0, else min(most, the CPUs it may run on)
    (os.cpu_count() counts CPUs it may be barred from)."""
    if configured > 0:
        return int(configured)
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        n = os.cpu_count() or 1
    return max(1, min(int(most), n))


def for_each_thread(pid: int, fn) -> None:
    """fn(tid) for every thread of process `pid` (the process itself where /proc has no task list); a thread that
    ended meanwhile is skipped."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        tids = [pid]
    for tid in tids:
        try:
            fn(tid)
        except ProcessLookupError:
            pass


def renice_process(pid: int, nice: int) -> None:
    """Set the niceness of every thread of process `pid` to `nice` (Linux's niceness is per thread; threads started
    later inherit their creator's). Lowering it needs privileges (root, CAP_SYS_NICE or RLIMIT_NICE): a UserError
    says so. A thread that ended meanwhile is skipped."""
    try:
        for_each_thread(pid, lambda tid: os.setpriority(os.PRIO_PROCESS, tid, int(nice)))
    except PermissionError:
        raise UserError(f"env_nice: cannot set niceness {nice} on process {pid}: lowering a niceness needs root "
                        f"or CAP_SYS_NICE (bench rows with different env_nice lower it between rows; set env_nice "
                        f"for the whole bench instead)") from None


def own_nice() -> int:
    """This process's niceness (what a worker reniced back to `env_nice=0` returns to)."""
    return os.getpriority(os.PRIO_PROCESS, 0)


def can_lower_nice(to: int) -> bool:
    """Whether this process may set a niceness below its workers' current one down to `to`: root, or RLIMIT_NICE
    allowing it (Linux: the lowest niceness allowed is 20 - rlimit)."""
    if os.geteuid() == 0:
        return True
    import resource   # Unix only: here, not at the top of a module every platform imports

    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    return soft == resource.RLIM_INFINITY or 20 - soft <= to


def change_nice(pid: int | None, was: int, nice: int) -> int:
    """A worker's niceness setting changes from `was` to `nice` (0: as started, i.e. this process's): its running
    process (`pid`, None: not running) is reniced where the setting changed; returns the new setting, which the
    worker applies at its next start (EnvWorker.set_nice)."""
    nice = int(nice)
    if pid is not None and nice != was:
        renice_process(pid, nice or own_nice())
    return nice


def split_cpus(reserve: int, cpus: list[int] | None = None) -> tuple[list[int], list[int]] | None:
    """(server CPUs, env CPUs): the last `reserve` of `cpus` (default: usable_cpus()) for the servers, the rest for
    the envs; None when reserve is 0. A reserve that leaves the envs no CPU is a UserError naming the key."""
    reserve = int(reserve)
    if reserve == 0:
        return None
    if cpus is None and not hasattr(os, "sched_setaffinity"):
        raise UserError(f"server.reserve_cpus={reserve} pins processes to CPUs, which needs Linux "
                        f"(os.sched_setaffinity); set server.reserve_cpus=0 here")
    cpus = sorted(cpus if cpus is not None else usable_cpus())
    if reserve < 0 or reserve >= len(cpus):
        raise UserError(f"server.reserve_cpus={reserve}: must be 0 (off) or 1..{len(cpus) - 1} (this process may "
                        f"use {len(cpus)} CPUs, and the env workers need at least one)")
    return cpus[-reserve:], cpus[:-reserve]


def pin_process(pid: int, cpus: list[int]) -> None:
    """Pin every thread of process `pid` to `cpus` (threads it starts later inherit). A thread that ended meanwhile
    is skipped."""
    for_each_thread(pid, lambda tid: os.sched_setaffinity(tid, cpus))


def repin_process(pid: int, cpus: list[int] | None) -> None:
    """pin_process to `cpus`, or, with None, back to every CPU this process may use (undoes an earlier pin)."""
    pin_process(pid, list(cpus) if cpus else usable_cpus())


def change_pin(pid: int | None, was: list[int] | None, cpus: list[int] | None) -> list[int] | None:
    """A worker's pin set changes from `was` to `cpus` (None: not pinned): its running process (`pid`, None: not
    running) is pinned again, or unpinned where it was pinned; returns the new set, which the worker keeps for its
    next start (EnvWorker.set_cpus, ServerWorker.set_cpus)."""
    cpus = list(cpus) if cpus else None
    if pid is not None and (cpus or was):
        repin_process(pid, cpus)
    return cpus
