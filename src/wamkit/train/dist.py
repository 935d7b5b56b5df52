"""Process-group setup: torchrun ranks, or a one-rank group for a plain `python` process, and the relaunch of
`wamkit train nproc=N` under torch.distributed.run."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ and "RANK" in os.environ


FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")


def relaunch_under_torchrun(nproc: int, argv: list[str]) -> int:
    """Run `python -m torch.distributed.run --standalone --nproc_per_node=N -m wamkit.cli.main train ARGV`;
    returns its exit code.

    SIGTERM, SIGINT and SIGHUP to this process are passed on to torchrun (which stops its ranks) and this process
    waits for it: with the default handlers this launcher died alone and torchrun with every rank kept training as
    orphans, writing checkpoints that a later resume=true would then race with. Each signal is passed on once (a
    Ctrl-C in a terminal reaches torchrun and the ranks directly too; torchrun kills ranks that outlast its own
    timeout). After a signal: 143 for SIGTERM and 129 for SIGHUP (128 + signal, as the other verbs), and SIGINT
    re-raised as KeyboardInterrupt (the CLI's "interrupted", 130)."""
    import signal

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "wamkit.cli.main", "train", *argv]
    proc: subprocess.Popen | None = None
    received: list[int] = []

    def forward(signum: int, frame) -> None:
        if signum in received:
            return
        received.append(signum)
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass

    sigs = [getattr(signal, n) for n in FORWARDED_SIGNALS if hasattr(signal, n)]
    old = {s: signal.signal(s, forward) for s in sigs}      # before the start: no window where a signal is lost
    try:
        if not received:
            proc = subprocess.Popen(cmd)
            if received:                                    # arrived while Popen ran: torchrun did not get it
                proc.send_signal(received[0])
            rc = proc.wait()
        else:
            rc = 128 + received[0]
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if not received:
        return rc
    first = received[0]
    if first == signal.SIGINT:
        raise KeyboardInterrupt
    print(f"wamkit train: terminated ({signal.Signals(first).name}); torchrun and its ranks stopped "
          f"(torchrun exit code {rc})", file=sys.stderr, flush=True)
    return 128 + first


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool   # we created the process group (and destroy it at the end)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device_type(device: str) -> str:
    from wamkit.core.device import resolve_device

    return resolve_device(device)


def init_distributed(device: str = "auto") -> DistInfo:
    """Join (or create) the default process group: NCCL on GPU, gloo on CPU. Without torchrun: one rank."""
    dtype = resolve_device_type(device)
    # NCCL for CUDA tensors plus gloo for the few CPU-side collectives (sampler state, stats broadcast, barriers)
    backend = "cpu:gloo,cuda:nccl" if dtype == "cuda" else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if dtype == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    owns = False
    if not dist.is_initialized():
        if under_torchrun():
            dist.init_process_group(backend, device_id=dev if dtype == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    device_id=dev if dtype == "cuda" else None)
        owns = True
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev, owns)


def close_distributed(info: DistInfo) -> None:
    if info.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def broadcast_object(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
