"""Training data for the trainer: a `DataSource` (dataset + sample builder + collate + resumable sampler) and an
infinite batch stream that knows the sampler position of every batch it has handed out.

Sources
- a LeRobot v3 dataset directory (the default): `wamkit.data.LeRobotDataset` -> `wamkit.data.samples.TrainingSamples`
  (chunks of `horizon` actions through the policy's action pipeline) -> `collate`, sharded by
  `ResumableShardedSampler`;
- `dataset=package.module:function`: `function(cfg, policy) -> DataSource`, for custom or synthetic data (tests).

Sampler contract (`wamkit.data.samples.ResumableShardedSampler`): iterating yields this rank's sample indices of
one epoch (ranks take strided slices of one seeded permutation, so a global batch holds the same samples for any
world size); `state_dict()` taken right after a batch's last index was yielded is the position after that batch;
`load_state_dict(state)` continues from there. Its `position` counts this rank's samples, so on a different world
size it is translated through the global position (`translate_sampler_state`).
Batches continue across epoch boundaries (the tail of an epoch is completed by the head of the next one): no sample
is dropped but the `n mod world_size` the sampler trims.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from wamkit.core.errors import UserError
from wamkit.policies.catalog import import_target, is_import_target  # noqa: F401 - `package.module:attr` targets


@dataclass
class DataSource:
    fps: float | None                       # the dataset's fps (checked against cfg.fps)
    stats_dataset: Any                      # what compute_action_stats reads (has get_action_chunk, or an array)
    make_samples: Callable[[Any], Any]      # action pipeline -> map-style dataset of training samples
    collate: Callable[[list], dict]
    make_sampler: Callable[..., Any]        # (num_samples, rank, world_size, seed) -> resumable sampler
    description: str = ""


def lerobot_source(cfg, policy, cameras: list[str], horizon: int) -> DataSource:
    from wamkit.data import samples as S
    from wamkit.data.lerobot import LeRobotDataset

    if not cfg.dataset:
        raise UserError("dataset is not set (a LeRobot v3 dataset directory)")
    if not Path(cfg.dataset).is_dir():
        raise UserError(f"dataset {cfg.dataset!r} is not a directory")
    required = ["action"] + (["observation.state"] if policy.spec.input.state_dim > 0 else [])
    ds = LeRobotDataset(cfg.dataset, cameras=cameras, check_fps=cfg.fps,
                        allow_fps_mismatch=cfg.allow_fps_mismatch, required_features=required)
    ds.check_finite(required)     # a NaN/inf action or state trains a NaN model: named here, before the first step
    dim = math.prod(ds.features["action"].get("shape") or [1])
    if dim != policy.spec.action.dim:   # was the action pipeline's "QuantileNormalizeStep has 7 channels, input has 5"
        raise UserError(f"dataset {cfg.dataset}: its action feature 'action' has {dim} dims, policy "
                        f"{policy.spec.name!r} predicts {policy.spec.action.dim} (set its action dim to {dim}, "
                        f"e.g. policy_args.action_dim={dim})")

    size = policy.spec.input.image_size or None

    def make_samples(pipeline):
        return S.TrainingSamples(ds, horizon=horizon, cameras=cameras, image_size=size, action_pipeline=pipeline,
                                 state_key="observation.state" if policy.spec.input.state_dim > 0 else None)

    return DataSource(fps=ds.fps, stats_dataset=ds, make_samples=make_samples, collate=S.collate,
                      make_sampler=default_sampler, description=repr(ds))


def default_sampler(n: int, rank: int, world_size: int, seed: int):
    from wamkit.data.samples import ResumableShardedSampler

    return ResumableShardedSampler(n, num_replicas=world_size, rank=rank, seed=seed)


def translate_sampler_state(state: dict, world_size: int, rank: int) -> tuple[dict, str | None]:
    """A sampler state saved on another world size -> this rank's state at the same global position.
    Returns (state, warning or None)."""
    state = dict(state)
    old = int(state.get("num_replicas", world_size))
    if "position" not in state or old == world_size:
        return state, None
    global_pos = int(state["position"]) * old
    state.update(position=global_pos // world_size, num_replicas=world_size, rank=rank)
    warn = None
    if global_pos % world_size:
        warn = (f"sampler position {global_pos} (global) is not divisible by {world_size} ranks: "
                f"{global_pos % world_size} sample(s) of the epoch are skipped")
    return state, warn


def build_source(cfg, policy, cameras: list[str], horizon: int) -> DataSource:
    if is_import_target(cfg.dataset):
        src = import_target(cfg.dataset, what="dataset")(cfg, policy)
        if not isinstance(src, DataSource):
            raise UserError(f"{cfg.dataset} must return a wamkit.train.data.DataSource")
    else:
        src = lerobot_source(cfg, policy, cameras, horizon)
    check_fps(cfg, src.fps)
    return src


def check_fps(cfg, fps: float | None) -> None:
    if cfg.fps is None:
        raise UserError(f"fps is not set: set it to the fps the recipe expects (the dataset says {fps}); a "
                        "mismatch trains the wrong time scale")
    if fps is not None and abs(float(fps) - float(cfg.fps)) > 1e-6 and not cfg.allow_fps_mismatch:
        raise UserError(f"dataset fps is {fps} but the config expects fps={cfg.fps}; a different fps trains the "
                        f"wrong time scale (set fps={fps}, or allow_fps_mismatch=true)")


def ensure_action_stats(policy, source: DataSource, horizon: int, seed: int):
    """The policy's action pipeline with quantile stats: kept when it already normalizes, otherwise its steps plus a
    QuantileNormalizeStep whose q01/q99 come from the dataset (through the steps before normalization)."""
    from wamkit.data.transforms import ActionPipeline, QuantileNormalizeStep, compute_action_stats

    pipe = getattr(policy, "action_pipeline", None) or ActionPipeline([])
    if any(isinstance(s, QuantileNormalizeStep) for s in pipe.steps):
        return pipe, None
    stats = compute_action_stats(source.stats_dataset, horizon=horizon, pipeline_before_norm=pipe, seed=seed)
    return ActionPipeline([*pipe.steps, QuantileNormalizeStep(stats["q01"], stats["q99"])]), stats


class BatchStream:
    """Infinite micro-batches of one rank, with the sampler state after each batch.

    The DataLoader draws indices ahead of the training loop (workers prefetch), so the sampler's own position runs
    ahead; this batch sampler records the state after each batch in a FIFO, and `next()` pops the state that
    belongs to the batch it returns (DataLoader keeps batches in order)."""

    def __init__(self, dataset, sampler, collate, micro_batch: int, num_workers: int, seed: int,
                 pin_memory: bool = False):
        self.sampler = sampler
        self.micro_batch = micro_batch
        self._states: collections.deque = collections.deque()
        self.state = sampler.state_dict()
        gen = torch.Generator()
        gen.manual_seed(seed)
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=self, collate_fn=collate, num_workers=num_workers, pin_memory=pin_memory,
            persistent_workers=num_workers > 0, generator=gen, worker_init_fn=leave_signals_to_the_main_process)
        self._it = iter(loader)

    def __iter__(self):
        batch: list[int] = []
        empty_epochs = 0
        while True:
            got = False
            for idx in self.sampler:
                got = True
                batch.append(int(idx))
                if len(batch) == self.micro_batch:
                    self._states.append(self.sampler.state_dict())
                    yield batch
                    batch = []
            # epoch done: the sampler starts the next one; a partial batch is completed from it
            empty_epochs = 0 if got else empty_epochs + 1
            if empty_epochs >= 2:
                raise UserError("the data sampler yields no samples for this rank (dataset smaller than a batch?)")

    def next(self) -> dict:
        try:
            batch = next(self._it)
        except Exception as e:   # noqa: BLE001 - only a worker's wrapped user-facing error is rewritten
            short = one_line_worker_error(e)
            if short is None:
                raise
            raise short from None
        self.state = self._states.popleft()
        return batch

    def close(self) -> None:
        """Stop the loader's worker processes now. The iterator refers back to this stream (its batch sampler): left
        alone, the persistent workers live on until the cyclic GC frees both, and their shutdown (joins of up to 5 s
        a worker) then runs in whichever thread that collection starts. Dropping the only reference runs it here."""
        self._it = None


def leave_signals_to_the_main_process(worker_id: int) -> None:
    """DataLoader worker_init_fn: SIGINT and SIGTERM sent to the whole process group (Ctrl-C, `kill -- -PGID`, a
    scheduler's job kill) are the main process's to handle: it finishes the step, checkpoints and shuts its loader
    down, which ends the workers. A worker that died of the group's SIGTERM made the main process fail at once with
    "DataLoader worker (pid ...) is killed by signal: Terminated" (a 40-line traceback, no checkpoint). SIGINT is
    ignored; SIGTERM is blocked and taken by a thread that exits the worker only when the main process sent it (the
    loader's own `terminate()` of a worker that did not stop; torch's C handler did the same, but died of any other
    sender's SIGTERM). A worker whose main process was killed (SIGKILL) still exits by the loader's watchdog."""
    import os
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})   # threads started after this inherit the mask
    parent = os.getppid()

    def wait_for_sigterm() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
            pass
        os._exit(0)

    threading.Thread(target=wait_for_sigterm, name="wamkit-worker-sigterm", daemon=True).start()


def one_line_worker_error(e: Exception) -> Exception | None:
    """A UserError/RunError raised in a DataLoader worker comes back as the same type (every wamkit error can be
    built from one message) with torch's message "Caught X in DataLoader worker process N. Original Traceback ...",
    the worker's whole traceback: the one line the CLI prints was 25 lines. Returns the error again with the original
    message (the traceback's last line), or None for anything else."""
    from wamkit.core.errors import RunError

    msg = str(e)
    if not isinstance(e, (UserError, RunError)) or " in DataLoader worker process " not in msg or \
            "Original Traceback" not in msg:
        return None
    err = type(e).__new__(type(e))
    Exception.__init__(err, msg.strip().splitlines()[-1].partition(": ")[2])   # not the subclass's __init__,
    return err                                                                   # which would format it again


def to_device(x, device: torch.device, host_keys: tuple[str, ...] = ()):
    """A collated batch onto `device`: tensors copied non_blocking (from the loader's pinned memory the copy
    overlaps other work), entries named in `host_keys` (at any depth) left where they are."""
    if torch.is_tensor(x):
        return x.to(device, non_blocking=True)
    if isinstance(x, dict):
        return {k: (v if k in host_keys else to_device(v, device, host_keys)) for k, v in x.items()}
    return x


def _device_tensors(x):
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _device_tensors(v)


class DevicePrefetcher:
    """Batches on the device one step ahead of the loop.

    `take()` gives (collated batch, sampler state after it) (BatchStream: `lambda: (s.next(), s.state)`). With
    `thread` (default: on CUDA) a background thread takes the next batch from the loader and issues its
    host-to-device copy (pinned memory, non_blocking, on a side CUDA stream) while the current step runs; `next()`
    only makes the compute stream wait for that copy. The loop's thread then does no loader work at all (queue
    handoff, worker-result unpickling, the copies). `state` is the sampler state of the batch `next()` returned last
    (what a checkpoint saves), however far ahead the thread has read. An exception in the thread (a UserError of the
    sampler, a dataset error) is raised by the `next()` that would have returned its batch.

    Without a thread (CPU) `next()` takes and copies in place: the same batches in the same order."""

    _END = object()

    def __init__(self, take, device: torch.device, host_keys: tuple[str, ...] = (), thread: bool | None = None,
                 initial_state=None):
        import queue
        import threading

        self.take, self.device, self.host_keys = take, torch.device(device), tuple(host_keys)
        self.state = initial_state
        cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._thread = None
        if thread if thread is not None else cuda:
            self._q: queue.Queue = queue.Queue(maxsize=1)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._work, name="wamkit-prefetch", daemon=True)
            self._thread.start()

    def _fetch(self):
        batch, state = self.take()
        if self._copy_stream is None:
            return to_device(batch, self.device, self.host_keys), state, None
        with torch.cuda.stream(self._copy_stream):
            batch = to_device(batch, self.device, self.host_keys)
            ev = torch.cuda.Event()
            ev.record(self._copy_stream)
        return batch, state, ev

    def _work(self) -> None:
        import queue

        if self._copy_stream is not None and self.device.index is not None:
            torch.cuda.set_device(self.device)   # a new thread starts on device 0 (the rank's may be another)
        while not self._stop.is_set():
            try:
                item = self._fetch()
            except BaseException as e:   # noqa: BLE001 - handed to the loop's thread, raised there
                item = (self._END, e, None)
            while not self._stop.is_set():
                try:
                    self._q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[0] is self._END:
                return

    def next(self) -> dict:
        if self._thread is None:
            batch, state, ev = self._fetch()
        else:
            batch, state, ev = self._q.get()
            if batch is self._END:
                raise state
        if ev is not None:   # the compute stream waits for the copy; the allocator learns the tensors' new stream
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ev)
            for t in _device_tensors(batch):
                if t.device.type == "cuda":
                    t.record_stream(stream)
        self.state = state
        return batch

    def close(self) -> None:
        import queue

        if self._thread is None:
            return
        self._stop.set()
        try:
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass
        self._thread.join(timeout=10)
        self._thread = None
