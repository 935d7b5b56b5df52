"""Training checkpoints: sharded, atomic, resumable on any number of ranks.

Layout of one checkpoint (`OUT/checkpoints/step-000500/`):

    model/               weights, sharded safetensors written by every rank through torch.distributed.checkpoint's
                         HuggingFaceStorageWriter (each file carries the offsets of its shards; DCP reshards on load)
    ema/                 EMA weights of the trainable parameters (same format; only with ema > 0)
    optim/               AdamW state in DCP's default format (only read when resuming)
    trainer_state.json   step, LR-scheduler state, data-sampler state of every rank, world size, samples seen
    rng/rank-00000.json  torch (CPU and CUDA), numpy and python RNG states of each rank
    config.json          the TrainConfig of the run
    policy.json          the policy manifest (wamkit.policies.manifest): policy name + constructor args + spec
    action_pipeline.json the policy's action pipeline with its normalizer stats

A checkpoint is written to `step-XXXXXX.tmp` by all ranks and renamed by rank 0 after a barrier, so a directory
named `step-XXXXXX` is always complete; the newest `keep_last` are kept. Weights are read back with safetensors
only (no pickle); `optim/` uses DCP's own format, whose metadata (`optim/.metadata`) is a pickle: loading it can run
code, so resume refuses a checkpoint whose files are not owned by the current user unless trust_checkpoint=True
(`check_checkpoint_owner`).

World-size changes on resume: model/optimizer/EMA are resharded by DCP. RNG states are restored per rank only when
the world size is unchanged; otherwise every rank is reseeded from (seed, step, rank) (documented in
docs/training.md). The data sampler's per-rank position is translated through the global position
(`wamkit.train.data.translate_sampler_state`), so any world size continues from the same sample.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from wamkit.core.errors import UserError
from wamkit.train.optim import reapply_hyperparameters, this_runs_hyperparameters

STEP_RE = re.compile(r"^step-(\d{6,})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    c = list_checkpoints(root)
    return c[-1] if c else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A step dir, a `checkpoints/` dir (newest step) or a run dir (its newest checkpoint) -> the step dir."""
    p = Path(path)
    if (p / "trainer_state.json").exists():
        return p
    for root in (p, p / "checkpoints"):
        c = latest_checkpoint(root)
        if c is not None:
            return c
    raise UserError(f"no training checkpoint found at {p} (expected step-XXXXXX/ with trainer_state.json)")


# ------------------------------------------------------------------------------------------------ RNG states

def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy())


def rng_state() -> dict:
    npst = np.random.get_state()
    st = {"torch": _b64(torch.get_rng_state()),
          "numpy": [npst[0], np.asarray(npst[1]).tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
          "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = _b64(torch.cuda.get_rng_state())
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(_unb64(st["torch"]))
    n = st["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = st["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(st["cuda"]))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    return (seed * 1_000_003 + rank * 7919 + step * 104_729) % 2**63


# ------------------------------------------------------------------------------------------------ save / load

@dataclass
class Resumed:
    step: int
    sampler_state: Any          # this rank's sampler state (or rank 0's after a world-size change)
    world_size_changed: bool
    samples_seen: int
    saved_world_size: int


def _json(obj) -> str:
    def default(o):
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
        if isinstance(o, torch.Tensor):
            return o.tolist()
        raise TypeError(f"not JSON serializable: {type(o).__name__}")

    return json.dumps(obj, indent=1, default=default)


def _reason(e: BaseException) -> str:
    """The first line of what went wrong: DCP wraps each rank's exception (with its traceback) in a
    CheckpointException whose text is a multi-rank traceback."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = str(e).strip().splitlines()
    msg = text[0] if text else ""
    msg = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return msg if len(msg) <= 300 else msg[:297] + "..."


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _free_space(path: Path) -> str:
    try:
        return _human_bytes(shutil.disk_usage(path).free) + " free"
    except OSError:
        return "free space unknown"


# what a checkpoint write fails with when the disk is full or unwritable: OSError (ENOSPC, EDQUOT, EROFS), the
# RuntimeError of torch's zip writer ("unexpected pos ..."), DCP's CheckpointException wrapping either
SAVE_ERRORS = (OSError, RuntimeError, CheckpointException)


def _scheduler_state(sched) -> dict:
    return {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}


def save_checkpoint(root: str | Path, step: int, *, model, optimizer, scheduler, ema, sampler_state, samples_seen: int,
                    meta: dict[str, Any], rank: int, world_size: int, keep_last: int) -> Path:
    """Collective: every rank calls it. `meta` maps file names (config.json, policy.json, ...) to JSON-able dicts
    (or to callables path -> None that write the file); rank 0 writes them.

    A write that fails (disk full, quota, read-only) on any rank is a UserError on every rank naming the directory
    and its free space, and the partial `step-XXXXXX.tmp` is removed (it was left behind, filling the disk, under a
    63-line traceback of torch's zip writer). The ranks agree on the outcome before rank 0 renames, so none is left
    waiting in a barrier. Peak disk use is keep_last + 1 checkpoints: old ones are deleted after the rename."""
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / (step_dir_name(step) + ".tmp")
    err: str | None = None
    if rank == 0:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / "rng").mkdir(parents=True)
        except OSError as e:
            err = _reason(e)
    err = broadcast_error(err)                 # rank 0's mkdir outcome on every rank; also the barrier before writing
    if err is None:
        try:
            msd, osd = get_state_dict(model, optimizer)
            dcp.save(msd, storage_writer=HuggingFaceStorageWriter(str(tmp / "model"), save_distributed=True))
            if ema is not None:
                dcp.save(ema.state_dict(),
                         storage_writer=HuggingFaceStorageWriter(str(tmp / "ema"), save_distributed=True))
            dcp.save({"optim": osd}, checkpoint_id=str(tmp / "optim"))
            (tmp / "rng" / f"rank-{rank:05d}.json").write_text(_json(rng_state()))
        except SAVE_ERRORS as e:
            err = _reason(e)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (sampler_state, err))
    errors = [e for _, e in gathered if e]
    if rank == 0 and not errors:
        try:
            state = {"step": step, "world_size": world_size, "samples_seen": samples_seen,
                     "scheduler": _scheduler_state(scheduler), "sampler": [s for s, _ in gathered]}
            (tmp / "trainer_state.json").write_text(_json(state))
            for name, content in meta.items():
                if callable(content):
                    content(tmp / name)
                else:
                    (tmp / name).write_text(_json(content))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        except SAVE_ERRORS as e:
            errors.append(_reason(e))
        else:
            for old in list_checkpoints(root)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    box = [errors[0] if errors else None]
    dist.broadcast_object_list(box, src=0)     # rank 0's outcome (rename included) for every rank; also the barrier
    if box[0] is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        newest = latest_checkpoint(root)
        raise UserError(f"could not write checkpoint {tmp} ({_free_space(root)} on that file system): {box[0]}; the "
                        f"partial checkpoint was removed, the newest complete one is {newest or 'none'}")
    return final


def broadcast_error(err: str | None) -> str | None:
    """Rank 0's error (or None) on every rank."""
    box = [err]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_checkpoint_owner(path: str | Path, trust: bool = False) -> None:
    """Refuse (UserError) a checkpoint whose step dir, `optim/` dir or any file in `optim/` is not owned by the
    current user: DCP reads the optimizer metadata with pickle, which runs code that whoever wrote it chose."""
    if trust:
        return
    path = Path(path)
    me = os.geteuid()
    optim = path / "optim"
    for p in [path, optim, *(sorted(optim.rglob("*")) if optim.is_dir() else [])]:
        try:
            uid = p.lstat().st_uid
        except FileNotFoundError:
            continue
        if uid != me:
            raise UserError(f"checkpoint file {p} is owned by uid {uid}, not by the current user (uid {me}); resume "
                            f"reads its optimizer state through pickle (torch DCP), which can run code: pass "
                            f"trust_checkpoint=true only if you trust whoever wrote it")


def load_checkpoint(path: str | Path, *, model, optimizer, scheduler, ema, rank: int, world_size: int,
                    seed: int, trust: bool = False) -> Resumed:
    """Collective: restore model, optimizer, scheduler, EMA and RNG in place; returns the step to continue after.
    The checkpoint must be owned by the current user unless `trust` (see check_checkpoint_owner)."""
    path = Path(path)
    check_checkpoint_owner(path, trust)
    state = read_json_file(path / "trainer_state.json")
    try:
        sched = dict(state["scheduler"])
        step = int(state["step"])
        saved_world = int(state["world_size"])
        samplers = list(state["sampler"])
        samples_seen = int(state.get("samples_seen", 0))
    except (KeyError, TypeError, ValueError) as e:
        raise corrupt(path / "trainer_state.json", e) from None
    changed = saved_world != world_size
    if len(samplers) != saved_world:
        raise corrupt(path / "trainer_state.json", f"{len(samplers)} sampler states for world_size {saved_world}")
    fresh = this_runs_hyperparameters(optimizer)
    msd, osd = get_state_dict(model, optimizer)
    with loading(path / "model"):
        dcp.load(msd, storage_reader=HuggingFaceStorageReader(str(path / "model")))
    optim_box = {"optim": osd}
    # partial: a trainable parameter that never received a gradient (wam-ref: the last text layer's query and MLP,
    # whose outputs nothing reads) has no AdamW state in the checkpoint; it keeps the fresh (zero) state that
    # get_state_dict gave it. Weights are loaded strictly.
    with loading(path / "optim"):
        dcp.load(optim_box, checkpoint_id=str(path / "optim"), planner=DefaultLoadPlanner(allow_partial_load=True))
    with loading(path, "does not fit this model or optimizer"):
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=optim_box["optim"])
    parts = [(path / "model", msd), (path / "optim", optim_box["optim"])]
    if ema is not None:
        if not (path / "ema").exists():
            raise UserError(f"{path} has no EMA weights but ema={ema.decay} is set")
        sd = ema.state_dict()
        with loading(path / "ema"):
            dcp.load(sd, storage_reader=HuggingFaceStorageReader(str(path / "ema")))
        ema.load_state_dict(sd)
        parts.append((path / "ema", sd))
    check_finite(parts, f"resume from an earlier checkpoint (move {path} away)",
                 frozenset(n for n, _ in model.named_buffers()))
    sched["lr_lambdas"] = [None] * len(optimizer.param_groups)
    with loading(path / "trainer_state.json", "has a scheduler state that does not fit"):
        scheduler.load_state_dict(sched)
    reapply_hyperparameters(optimizer, scheduler, fresh)
    rng_file = path / "rng" / f"rank-{rank:05d}.json"
    if not changed and rng_file.exists():
        rng = read_json_file(rng_file)
        with loading(rng_file):
            set_rng_state(rng)
    else:
        if not changed and rank == 0:
            print(f"wamkit train: warning: {rng_file} is missing: every rank is reseeded from (seed, rank, step), so "
                  f"the resumed run is not bit-identical to an uninterrupted one", flush=True)
        seed_everything(rank_seed(seed, rank, step))
    sampler_state = samplers[rank] if not changed else samplers[0]
    return Resumed(step, sampler_state, changed, samples_seen, saved_world)


def corrupt(path: Path, why: BaseException | str, what: str = "is corrupt or incomplete") -> UserError:
    """The one-line error for a checkpoint file or directory that cannot be read."""
    return UserError(f"checkpoint {path} {what}: {why if isinstance(why, str) else _reason(why)}")


def read_json_file(path: Path) -> dict:
    """A checkpoint's JSON file, or a UserError naming it (a truncated file was a bare JSONDecodeError traceback)."""
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"checkpoint {path.parent} is incomplete: {path} is missing") from None
    except (OSError, ValueError) as e:       # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise corrupt(path, e) from None
    if not isinstance(obj, dict):
        raise corrupt(path, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _quiet_dcp(record: logging.LogRecord) -> bool:
    """Logging filter: DCP logs a failed metadata read with its traceback on the root logger before it raises."""
    return "torch/distributed/checkpoint" not in record.pathname.replace("\\", "/")


@contextlib.contextmanager
def loading(path: Path, what: str = "is corrupt or incomplete"):
    """`with loading(path):` turns whatever reading `path` raises (DCP's CheckpointException with every rank's
    traceback, safetensors' header errors, a missing directory, a size mismatch) into one line naming the path."""
    if not path.exists():
        raise UserError(f"checkpoint {path.parent} is incomplete: {path} is missing")
    root = logging.getLogger()
    root.addFilter(_quiet_dcp)
    try:
        yield
    except UserError:
        raise
    except (Exception, CheckpointException) as e:
        raise corrupt(path, e, what) from None
    finally:
        root.removeFilter(_quiet_dcp)


def load_weights_into(module: torch.nn.Module, ckpt: str | Path, weights: str = "auto") -> str:
    """Single process, no FSDP: load a checkpoint's weights into a plain module (safetensors only).
    weights: "model", "ema" or "auto" (EMA when the checkpoint has it). Returns which weights were loaded."""
    ckpt = Path(ckpt)
    if weights == "auto":
        weights = "ema" if (ckpt / "ema").exists() else "model"
        if weights == "model" and _trained_with_ema(ckpt):
            raise UserError(f"{ckpt} was trained with EMA but has no ema/ weights (an incomplete copy?): pass "
                            f"weights=model to use the raw weights")
    if weights not in ("model", "ema"):
        raise UserError(f"weights must be auto, model or ema, got {weights!r}")
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sd = {k: v.detach().clone() for k, v in module.state_dict().items()}
    with loading(ckpt / "model"):
        dcp.load(sd, storage_reader=HuggingFaceStorageReader(str(ckpt / "model")), no_dist=True)
    ema_keys: set[str] = set()   # the weights the EMA replaced (checked for NaN/inf as the EMA's)
    if weights == "ema":
        if not (ckpt / "ema").exists():
            raise UserError(f"{ckpt} has no EMA weights (trained with ema=0)")
        with loading(ckpt / "ema"):
            ema_keys = _safetensors_keys(ckpt / "ema")
            missing = sorted(ema_keys - set(sd))
            if missing:
                raise ValueError(f"weights {missing[:3]} are not in the policy")
            ema_sd = {k: sd[k] for k in ema_keys}
            dcp.load(ema_sd, storage_reader=HuggingFaceStorageReader(str(ckpt / "ema")), no_dist=True)
        sd.update(ema_sd)
    check_finite([(ckpt / "ema", {k: v for k, v in sd.items() if k in ema_keys}),
                  (ckpt / "model", {k: v for k, v in sd.items() if k not in ema_keys})], "use an earlier checkpoint",
                 frozenset(n for n, _ in module.named_buffers()))
    with loading(ckpt / "model", "does not fit the policy its policy.json builds"):
        module.load_state_dict(sd, strict=True)
    return weights


def _trained_with_ema(ckpt: Path) -> bool:
    try:
        cfg = json.loads((ckpt / "config.json").read_text())
        return float(cfg.get("ema") or 0) > 0
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def _keys_by_file(d: Path) -> dict[Path, set[str]]:
    from safetensors import safe_open

    found: dict[Path, set[str]] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            found[f] = set(fh.keys())
    return found


def _safetensors_keys(d: Path) -> set[str]:
    return set().union(*_keys_by_file(d).values())


# ------------------------------------------------------------------------------------------------ finiteness

def _named_tensors(sd: dict, prefix: str = ""):
    """(dotted name, tensor) of a nested state dict; a DTensor gives this rank's shard."""
    for k, v in sd.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _named_tensors(v, name + ".")
        elif torch.is_tensor(v):
            yield name, v.to_local() if hasattr(v, "to_local") else v


def first_non_finite(sd: dict, buffers: frozenset[str] = frozenset()) -> str | None:
    """The name of the first floating tensor of `sd` holding a NaN or inf, or None; the tensors named in `buffers`
    (a module's buffers: an additive attention mask may hold -inf by design) only for NaN. One check per tensor,
    read back in one transfer per device: cheap next to reading the weights."""
    by_device: dict[torch.device, list[tuple[int, str, torch.Tensor]]] = {}
    for k, (name, t) in enumerate(_named_tensors(sd)):
        if t.is_floating_point() and t.numel():
            ok = ~torch.isnan(t).any() if name in buffers else torch.isfinite(t).all()
            by_device.setdefault(t.device, []).append((k, name, ok))
    bad = []
    for flags in by_device.values():
        ok = torch.stack([f for _, _, f in flags]).cpu()
        bad += [flags[int(i)][:2] for i in torch.nonzero(~ok).flatten()]
    return min(bad)[1] if bad else None


def non_finite_error(d: Path, name: str, use: str) -> UserError:
    """One line naming the file(s) of checkpoint part `d` (model/, ema/, optim/) whose tensor `name` holds NaN/inf:
    bytes damaged on disk load without complaint (safetensors checks sizes, not values), and a NaN weight made the
    resumed run fail blaming its data or lr, or `wamkit export` write a policy that predicts NaN."""
    files = []
    for f, keys in _keys_by_file(d).items() if d.name != "optim" else ():
        if name in keys:
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as fh:
                if not bool(torch.isfinite(fh.get_tensor(name)).all()):
                    files.append(str(f))
    where = ", ".join(files) or str(d)
    return UserError(f"checkpoint file {where} holds NaN/inf values in tensor {name!r}: it is corrupt (no step "
                     f"that produced NaN/inf is ever checkpointed); {use}")


def check_finite(parts: list[tuple[Path, dict]], use: str, buffers: frozenset[str] = frozenset()) -> None:
    """UserError (on every rank, when a process group is up: the ranks agree) naming the first (part, tensor) of
    `parts` ([(checkpoint part dir, state dict loaded from it)]) that holds NaN/inf on any rank (`buffers`: names
    checked for NaN only, see first_non_finite)."""
    bad = next(((d, n) for d, sd in parts if (n := first_non_finite(sd, buffers)) is not None), None)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        got: list = [None] * dist.get_world_size()
        dist.all_gather_object(got, (str(bad[0]), bad[1]) if bad else None)
        bad = next(((Path(d), n) for d, n in (g for g in got if g)), None)
    if bad is not None:
        raise non_finite_error(bad[0], bad[1], use)
