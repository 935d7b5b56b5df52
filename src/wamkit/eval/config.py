"""`wamkit eval` configuration: one flat, typed dataclass; defaults live here.

    wamkit eval env=libero suite=libero_object tasks=0,1 trials=2 policy=zero out=runs/x
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from wamkit.core.errors import ConfigError


@dataclass
class ServerOptions:
    """The local action server started when inference=server."""

    port: int = 0                 # 0 = pick a free port
    max_batch_size: int = 64      # the server's cap on observations per batch
    max_wait_ms: float = 2.0      # how long the server lets a batch fill up
    token: str | None = None      # bearer token of the server(s) (None: env WAMKIT_TOKEN, else no auth)
    url: str | None = None        # use already running server(s) (wamkit serve or SGLang; comma-separated for several)
    protocol: str = "wamkit"      # wire form: wamkit (HTTP, wamkit's extensions) | sglang (HTTP, SGLang's request form)
    startup_timeout_s: float = 300.0  # give up when a started server is not healthy after this long
    replicas: int = 1             # local servers to start (e.g. one per GPU); requests go to the least loaded one
    gpus: list[int] | None = None  # replica i sees only GPU gpus[i % len(gpus)] (CUDA_VISIBLE_DEVICES); None: all
    serve_args: dict[str, Any] = field(default_factory=dict)  # more `wamkit serve` keys, e.g. {torch_threads: 8}


DEFAULT_SUITES = {"libero": "libero_object", "metaworld": "mt"}


@dataclass
class EvalConfig:
    env: str = "libero"                     # simulator: libero | metaworld
    suite: str = ""                         # "" = the env's standard suite (libero: libero_object, metaworld: mt)
    tasks: list[int] | None = None          # task ids; None = every task of the suite
    trials: int = 50                        # init states per task: trial = init-state index 0..trials-1
    trial_start: int = 0                    # first init-state index (trials trial_start..trial_start+trials-1)
    policy: str = "zero"                    # registered policy name or a directory written by `wamkit export`
    policy_args: dict[str, Any] = field(default_factory=dict)  # policy constructor keys, e.g. policy_args.size=tiny
    horizon: int | None = None              # actions per chunk; None = the policy's / env's default
    max_steps: int | None = None            # None = the suite's standard max steps
    image_size: int = 256                   # camera images are image_size x image_size pixels
    env_args: dict[str, Any] = field(default_factory=dict)  # env options, e.g. env_args.tasks=reach-v3 (MetaWorld)
    out: str = "runs/eval"                  # output dir: results.jsonl, summary.json, report.md, timeline, videos
    save_videos: int = 0                    # record the first N planned episodes as mp4 (renders every step for them)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # the policy's device unless policy_args.device says; auto: GPU
                                            # when present (inference=server: resolved by each server, on its host)
    inference: Literal["inprocess", "server"] = "inprocess"  # policy in this process, or behind local/remote servers
    server: ServerOptions = field(default_factory=ServerOptions)
    mode: Literal["serial", "pipelines", "auto"] = "serial"  # scheduler (docs/evaluation.md); auto: the fastest
    num_envs: int = 1                       # env worker processes (mode=serial uses one, whatever this says)
    batch: int = 1                          # pipelines: observations per request (B)
    pipelines: int = 1                      # pipelines: number of env groups (P)
    depth: int = 0                          # auto: max requests in flight (0 = chosen from measurements)
    max_batch: int = 0                      # auto: cap on observations per request (0 = policy/server max)
    group_by_task: bool | None = None       # one task per request (None: only for SGLang, which needs equal prompts)
    run_to_max_steps: bool = False          # the reference's semantics: keep stepping after success
    render_every_step: bool = False         # the single-batch baseline: render every step
    resume: bool = False                    # continue the run in out= (skips episodes already in results.jsonl)
    seed: int = 0                           # env and policy noise seed
    progress: bool = True                   # progress bar with ETA on stderr
    runtime: Literal["local", "ray"] = "local"  # where env workers and servers run (docs/ray.md)
    ray: dict[str, Any] = field(default_factory=dict)  # runtime=ray options, e.g. ray.address=auto (docs/ray.md)
    max_episode_retries: int = 3            # re-runs of an episode whose env worker crashed
    logger: Literal["none", "wandb"] = "none"  # wandb: also log episodes and the summary to Weights & Biases
                                            # (pip install wandb; WANDB_MODE=offline works without an account)
    wandb_project: str = "wamkit"           # the W&B project of logger=wandb (run name: the out= dir's name)

    def __post_init__(self) -> None:
        if not self.suite:
            self.suite = DEFAULT_SUITES.get(self.env, "")

    def validate(self) -> None:
        if self.trials < 1:
            raise ConfigError("trials must be >= 1")
        if self.num_envs < 1:
            raise ConfigError("num_envs must be >= 1")
        if self.mode == "pipelines":
            if self.pipelines < 1 or self.batch < 1:
                raise ConfigError("pipelines and batch must be >= 1")
            if self.num_envs < self.pipelines:
                raise ConfigError(f"num_envs ({self.num_envs}) must be >= pipelines ({self.pipelines})")
        if self.save_videos < 0:
            raise ConfigError("save_videos must be >= 0")
        if self.server.replicas < 1:
            raise ConfigError(f"server.replicas must be >= 1, got {self.server.replicas}")
        if self.server.replicas > 1 and self.server.port:
            raise ConfigError("server.port must be 0 (pick free ports) when server.replicas > 1")
