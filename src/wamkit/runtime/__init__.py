"""Where workers run: local processes (default) or a Ray cluster. Knows nothing of what the workers do.

`eval_runtime(cfg)` gives the keyword arguments that place an evaluation's workers (pass them to
`wamkit.eval.runner.run_eval`): env worker handles and the action-server worker, for `runtime=local|ray`."""

from __future__ import annotations

from typing import Any


def require_ray() -> None:
    """One line before any work when Ray is missing (it is an optional dependency), not an import traceback."""
    import importlib.util

    from wamkit.core.errors import UserError

    try:
        found = importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):   # a broken or half-installed package
        found = False
    if not found:
        raise UserError("runtime=ray needs Ray: pip install 'wamkit[ray]'")


def eval_runtime(cfg: Any) -> dict[str, Any]:
    """run_eval keyword arguments for cfg.runtime ('local': {} = local processes; 'ray': Ray actors)."""
    if cfg.runtime == "local":
        return {}
    if cfg.runtime == "ray":
        require_ray()
        from wamkit.runtime.ray_runtime import make_ray_env_workers, ray_server_worker_factory
        from wamkit.runtime.ray_session import RayOptions

        opts = RayOptions.from_any(cfg.ray)
        n_envs = cfg.env_count()
        return {"env_workers": lambda env, kwargs, n: make_ray_env_workers(env, kwargs, n, opts),
                "server_worker_factory": ray_server_worker_factory(opts),
                "cores": max(1, int(round(n_envs * opts.num_cpus_per_env)))}
    from wamkit.core.errors import unknown_choice

    raise unknown_choice("runtime", cfg.runtime, ["local", "ray"])
