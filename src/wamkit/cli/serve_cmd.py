"""`wamkit serve [config.yaml] policy=NAME port=P max_batch_size=N max_wait_ms=MS max_wait_fraction=F
token_file=PATH policy_args.k=v ...`

Runs the action server (wamkit.serve.app) on uvicorn. policy= is a registered name, `package.module:Class` (a
module on PYTHONPATH or in the current directory) or an export directory. SIGTERM / Ctrl-C: stop accepting, finish
in-flight work, exit. The token: the environment variable WAMKIT_TOKEN or token_file= (a file readable by you only);
token= works too, but the command line is visible to every user in `ps`. A host other than loopback needs a token
(or allow_insecure=true); a port in use, a missing or empty token file is one line and exit code 2. Limits and
timeouts: docs/serving.md."""

from __future__ import annotations

import os
import signal
import sys
import threading

from wamkit.core.config import config_help, load_config, split_args
from wamkit.serve.config import ServeConfig, http_url


def help_text(argv: list[str]) -> str:
    from wamkit.policies.registry import policy_names

    return config_help(ServeConfig, "usage: wamkit serve [config.yaml] [key=value ...]", __doc__,
                       f"policy: {' | '.join(policy_names())} | package.module:Class (your own: docs/models.md, "
                       f"\"Bring your own model\") | a directory written by `wamkit export`\n"
                       "routes: docs/serving.md (GET /metrics: JSON; Prometheus text at /metrics/prometheus)")


def _server_class():
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn's server, plus: on SIGTERM/SIGINT flush the batcher so queued work runs now, not after
        max_wait_ms; uvicorn then waits for in-flight requests before the lifespan shutdown."""

        action_server = None

        def handle_exit(self, sig, frame) -> None:
            if self.action_server is not None:
                self.action_server.begin_shutdown()
            super().handle_exit(sig, frame)

        def request_exit(self) -> None:
            self.handle_exit(signal.SIGTERM, None)

    return _Server


def _watch_parent(pid: int, server) -> None:
    """Exit (gracefully) when the process that launched us dies: no orphaned servers."""
    ev = threading.Event()
    while not ev.wait(1.0):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            server.request_exit()
            return
        except PermissionError:
            pass
        if os.getppid() == 1 and pid != 1:
            server.request_exit()
            return


def main(argv: list[str]) -> int:
    path, overrides = split_args(argv)
    cfg = load_config(ServeConfig, path, overrides)
    from wamkit.core.heap import freeze_heap
    from wamkit.serve.app import create_app
    from wamkit.serve.http import bind_socket, tune_malloc, uvicorn_config

    tune_malloc()   # before the policy and the server allocate anything large

    sock = bind_socket(cfg.host, cfg.port)   # before the policy is built: a taken port fails at once
    port = sock.getsockname()[1]
    app = create_app(cfg)
    freeze_heap()   # the policy is built and warm: full collections from now on skip it (core/heap.py)
    srv = app.state.server
    server = _server_class()(uvicorn_config(app, cfg, srv.metrics))
    server.action_server = srv
    if cfg.parent_pid > 0:
        threading.Thread(target=_watch_parent, args=(cfg.parent_pid, server), daemon=True).start()
    auth = "token required" if srv.token else "no auth"
    print(f"wamkit serve: policy={cfg.policy} max_batch_size={srv.max_batch_size} max_wait_ms={cfg.max_wait_ms} "
          f"max_wait_fraction={cfg.max_wait_fraction} on {http_url(cfg.host, port)} ({auth})", file=sys.stderr,
          flush=True)
    server.run(sockets=[sock])
    return 0
