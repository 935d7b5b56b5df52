"""What every caller of `Policy.predict` checks, in one place: `wamkit serve` (its batcher), the in-process evaluation
(`wamkit.eval.inference`) and the action server's input check read these functions, so a policy is held to the same
rules whatever runs it.

- Output (`check_chunks`): a float array (another float dtype, a list of numbers or a torch tensor is converted to
  float32), of shape (N, H, action_dim) with N the number of observations; H at least the horizon asked for (a
  longer chunk is cut to it, a shorter one refused: the rule of `action_horizon` on the server and of `horizon=` in
  evaluation); finite. Anything else is a PolicyOutputError naming the policy and what was wrong (the server answers
  500 and keeps serving; an evaluation stops with that line).
- Input (`observation_problem`, `env_problem`): the cameras and the state length the policy's spec says it reads.
- `read_only`: observations whose arrays the policy cannot change (a policy that wrote into an image changed the
  frame the episode's video recorded).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from wamkit.core.errors import RunError
from wamkit.core.types import Observation
from wamkit.policies.base import PolicySpec


class PolicyOutputError(RunError):
    """A policy answered with actions no env can execute: one line naming the policy and what was wrong."""


def policy_label(policy: Any) -> str:
    """"policy 'name'" for messages: spec.name, else the class name."""
    name = getattr(getattr(policy, "spec", None), "name", None) or type(policy).__name__
    return f"policy {name!r}"


def _as_array(out: Any, who: str) -> np.ndarray:
    if hasattr(out, "detach") and hasattr(out, "cpu") and type(out).__module__.startswith("torch"):
        t = out.detach()
        t = t.float() if t.is_floating_point() else t
        out = t.cpu().numpy()
    try:
        return np.asarray(out)
    except (ValueError, TypeError) as e:   # a ragged list, an object numpy cannot read
        raise PolicyOutputError(f"{who} returned a {type(out).__name__} that is not an array of actions "
                                f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); predict must return "
                                f"a float32 numpy array (N, horizon, action_dim)") from None


def check_chunks(out: Any, n: int, *, action_dim: int | None, horizon: int | None = None, who: str,
                 need: str = "", horizon_name: str = "") -> np.ndarray:
    """`out` (what predict returned for n observations) as finite float32 (n, horizon, action_dim) chunks, else
    PolicyOutputError. horizon: the chunk length asked for (None: any, not cut); need: who needs action_dim (for the
    shape message: "the envs need", default "its spec says"); horizon_name: the clause saying what asks for the
    horizon (default "its horizon is H")."""
    a = _as_array(out, who)
    if a.ndim != 3 or a.shape[0] != n or a.shape[1] < 1 or (action_dim is not None and a.shape[2] != action_dim):
        want = f"({n}, H, {action_dim if action_dim is not None else 'action_dim'})"
        raise PolicyOutputError(f"{who} returned actions of shape {list(a.shape)} for {n} observation(s); "
                                f"{need or 'its spec says'} {want}")
    if a.dtype.kind != "f":
        raise PolicyOutputError(f"{who} returned actions of dtype {a.dtype}; predict must return float32 actions")
    if horizon is not None:
        if a.shape[1] < horizon:
            says = horizon_name or f"its horizon is {horizon}"
            raise PolicyOutputError(f"{who} returned chunks of {a.shape[1]} actions; {says} (a shorter chunk is "
                                    f"refused, a longer one cut to it)")
        a = a[:, :horizon]
    if a.dtype != np.float32:
        with np.errstate(over="ignore"):   # float64 beyond float32's range becomes inf: refused just below
            a = a.astype(np.float32)
    bad = ~np.isfinite(a)
    if bad.any():
        rows = np.flatnonzero(bad.reshape(n, -1).any(axis=1))
        raise PolicyOutputError(f"{who} returned non-finite actions (NaN/inf) for {rows.size} of {n} "
                                f"observation(s) of a request (the first: observation {int(rows[0])})")
    return a


def observation_problem(spec: PolicySpec, obs: Observation, i: int = 0) -> tuple[str, str] | None:
    """(field path, what is wrong) for the first thing observation i lacks that the policy reads, else None: a
    camera of spec.input.cameras, or the spec.input.state_dim-long state. The paths are the action API's
    (`input.images[i].<camera>`, `input.state[i]`, `input.state[i].shape`)."""
    cams = [c for c in spec.input.cameras if c]
    for c in cams:
        if c not in obs.images:
            return f"input.images[{i}].{c}", f"missing camera (policy reads {cams})"
    sd = spec.input.state_dim
    if sd:
        if obs.state is None:
            return f"input.state[{i}]", f"missing (policy reads a {sd}-D state)"
        shape = list(np.shape(obs.state))
        if shape != [sd]:
            return f"input.state[{i}].shape", f"expected [{sd}], got {shape}"
    return None


def env_problem(spec: PolicySpec, cameras: Sequence[str], state_dim: int) -> str | None:
    """What a policy reads that an env does not give (one line), else None: a camera the env does not render, a
    state of another length (checked before any episode runs, as the server checks every request)."""
    name = spec.name
    need = [c for c in spec.input.cameras if c]
    lacking = [c for c in need if c not in cameras]
    if lacking:
        return (f"policy {name!r} reads camera(s) {lacking} that the env does not render (it renders "
                f"{list(cameras)}): set env_args.cameras to include them, or give the policy the env's cameras")
    sd = spec.input.state_dim
    if sd and sd != state_dim:
        return (f"policy {name!r} reads a {sd}-D state (spec.input.state_dim) but the env's state is "
                f"{state_dim}-D" + (f": give the policy state_dim={state_dim} (e.g. policy_args.state_dim)"
                                    if state_dim else ""))
    return None


def _read_only(a):
    if isinstance(a, np.ndarray) and a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def read_only(observations: Sequence[Observation]) -> list[Observation]:
    """The observations with read-only views of their arrays (no copy): a policy that writes into one gets
    "assignment destination is read-only" instead of changing what the caller keeps (video frames)."""
    return [Observation(images={k: _read_only(v) for k, v in o.images.items()}, state=_read_only(o.state),
                        task=o.task) for o in observations]
