"""ServeConfig: everything `wamkit serve` takes (YAML and/or key=value overrides via wamkit.core.config)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from wamkit.core.errors import ConfigError


@dataclass
class ServeConfig:
    policy: str = "random"                  # registered name or a directory written by `wamkit export`
    policy_args: dict[str, Any] = field(default_factory=dict)  # policy constructor keys, e.g. policy_args.size=tiny
    host: str = "127.0.0.1"                 # loopback by default; bind 0.0.0.0 only behind a token
    port: int = 8000                        # TCP port (0: pick a free one)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # the policy's device unless policy_args.device says; auto: GPU
                                            # when present
    max_batch_size: int = 0                 # 0: the policy's max_batch_size()
    max_wait_ms: float = 5.0                # how long a batch may wait to fill up
    max_queue: int = 1024                   # observations waiting; beyond that 503 + Retry-After
    max_body_mb: float = 64.0               # request body cap (413 beyond)
    token: str | None = None                # bearer token; None: env WAMKIT_TOKEN, else no auth
    log_every_s: float = 10.0               # one-line metrics summary to stderr (0: off)
    log_level: str = "warning"              # uvicorn's log level
    model_name: str | None = None           # the `model` field of responses (default: the policy name)
    graceful_timeout_s: float = 60.0        # on SIGTERM: wait this long for in-flight work
    parent_pid: int = 0                     # exit when this process dies (server workers set it)
    warmup: bool = True                     # policy.warmup(max batch) before /health answers (e.g. CUDA graphs)
    torch_threads: int = 0                  # torch intra-op threads of the server; 0: min(4, CPU cores) (the cores
                                            # belong to env workers: a large OpenMP team on busy cores stalls)

    def validate(self) -> None:
        if not (0 <= self.port < 65536):
            raise ConfigError(f"port: must be in 0..65535, got {self.port}")
        if self.max_batch_size < 0:
            raise ConfigError(f"max_batch_size: must be >= 0, got {self.max_batch_size}")
        if self.max_wait_ms < 0:
            raise ConfigError(f"max_wait_ms: must be >= 0, got {self.max_wait_ms}")
        if self.max_queue < 1:
            raise ConfigError(f"max_queue: must be >= 1, got {self.max_queue}")
        if self.torch_threads < 0:
            raise ConfigError(f"torch_threads: must be >= 0, got {self.torch_threads}")
        if self.max_body_mb <= 0:
            raise ConfigError(f"max_body_mb: must be > 0, got {self.max_body_mb}")

    def resolved_token(self) -> str | None:
        tok = self.token if self.token else os.environ.get("WAMKIT_TOKEN")
        return tok or None
