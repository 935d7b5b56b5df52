"""`wamkit eval` configuration: one flat, typed dataclass; defaults live here.

    wamkit eval env=libero suite=libero_object tasks=0,1 trials=2 policy=zero out=runs/x
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from wamkit.core.config import check_number
from wamkit.core.errors import ConfigError
from wamkit.serve.config import TOKEN_ENV, read_token_file

MIN_IMAGE, MAX_IMAGE = 8, 2048   # camera image side (pixels) an env may be asked to render


PROTOCOLS = ("auto", "wamkit", "sglang", "openpi", "sglang-ws")
LAUNCHERS = ("wamkit", "sglang")


@dataclass
class ServerOptions:
    """The action server(s) of inference=server: started here (`launch`) or given (`url`)."""

    port: int = 0                 # 0 = pick a free port
    max_batch_size: int = 64      # the server's cap on observations per batch
    max_wait_ms: float = 2.0      # how long the server lets a batch fill up
    idle_dispatch: bool = True    # wamkit serve: an idle server runs a partial batch at once unless other requests
                                  # are being received (then it waits up to max_wait_ms); false: every partial batch
                                  # waits max_wait_ms (docs/serving.md "Batching")
    token: str | None = None      # bearer token of the server(s) (None: token_file, else env WAMKIT_TOKEN; the
                                  # `wamkit serve` processes started here get a random one per run when none is
                                  # given); on the command line it shows in `ps`: prefer token_file or WAMKIT_TOKEN
    token_file: str | None = None  # a file holding the token (its first line, stripped; missing or empty: one line)
    url: str | None = None        # use already running server(s) (wamkit serve or SGLang; comma-separated for several)
    protocol: str = "auto"        # wire form: wamkit (HTTP + wamkit's extensions) | sglang (HTTP, SGLang's request
                                  # form) | openpi (websocket, openpi's policy protocol: pi0/pi0.5 servers, SGLang's
                                  # /openpi/policy, wamkit serve) | sglang-ws (websocket, /v1/actions/realtime) |
                                  # auto (sglang for policies served by SGLang, e.g. cosmos3; sglang-ws for the
                                  # `wamkit serve` started here: less overhead per request; else wamkit);
                                  # websocket urls: ws://host:port (docs/websocket.md)
    launch: str = "wamkit"        # what is started when no url is given: wamkit (`wamkit serve`) | sglang (`sglang
                                  # serve`, one per GPU of `gpus`; options in `sglang`)
    policy: str | None = None     # the policy `wamkit serve` runs (None: the evaluated policy; for cosmos3 on a CPU:
                                  # cosmos3-standin, SGLang's request form answered by any wamkit policy)
    policy_args: dict[str, Any] = field(default_factory=dict)  # that policy's arguments (with `policy`)
    sglang: dict[str, Any] = field(default_factory=dict)  # launch=sglang: model_path (required), batching_max_size,
                                  # batching_delay_ms, attention_backend, action_stats_path, extra_args, sglang_bin
    startup_timeout_s: float = 300.0  # give up when a started server is not healthy after this long
    request_timeout_s: float | None = None  # a request with no answer after this long counts as failed (and is
                                  # retried); None: the policy's own timeout_s where it has one (cosmos3), else 120
    retries: int = 4              # a failed request (no connection, timeout, 429/5xx) is retried at least this often
    retry_s: float = 120.0        # ... and for at least this long since its first failure: the outage a server at
                                  # server.url may take to come back (a restart elsewhere); then the run stops, and
                                  # resume=true continues it. Servers started here are restarted by the evaluation
    replicas: int = 1             # local servers to start (e.g. one per GPU); requests go to the least loaded one
    gpus: list[int] | None = None  # replica i sees only GPU gpus[i % len(gpus)] (CUDA_VISIBLE_DEVICES); None: all
    serve_args: dict[str, Any] = field(default_factory=dict)  # more `wamkit serve` keys, e.g. {torch_threads: 8}
    shm_arrays: bool = True       # the `wamkit serve` started here takes images and states through shared memory
                                  # (websocket protocols; wamkit.protocol.shm): no msgpack/socket copy of the arrays
    reserve_cpus: int = 0         # > 0: the servers started here run on the last N CPUs this process may use and the
                                  # local env workers on the rest (Linux; core/cpu_pinning.py); 0: no pinning

    def auth_token(self) -> str | None:
        """The token the user gave for the server(s): the file `token_file` names (read as `wamkit serve
        token_file=` reads it), else `token`, else the environment's WAMKIT_TOKEN; None: none (the servers started
        here then get one of their own: start_server_workers)."""
        return self.given_token() or os.environ.get(TOKEN_ENV) or None

    def given_token(self) -> str | None:
        """The token given in the config (token_file, else token), without the environment's."""
        if self.token_file:
            try:
                return read_token_file(self.token_file)
            except ConfigError as e:   # its message names `token_file=`: the key here is server.token_file
                raise ConfigError(f"server.{e}") from None
        return self.token or None

    def validate(self) -> None:
        if self.token and self.token_file:
            raise ConfigError("server.token and server.token_file both given: give the token one way (token_file "
                              "or WAMKIT_TOKEN keep it off the command line)")
        self.auth_token()   # a token file that cannot be read: one line now, before anything starts
        secret = sorted(k for k in self.serve_args if k in ("token", "token_file"))
        if secret:
            raise ConfigError(f"server.serve_args.{secret[0]}: give the servers' token as server.token_file= (or "
                              f"WAMKIT_TOKEN), which this evaluation's client sends too (serve_args go on their "
                              f"command line)")


@dataclass
class EvalConfig:
    # words: a *batch* is what one model call runs (the server's max_batch_size); a *request* is what the evaluation
    # sends (request_size observations, B in the reference's tables); old key spellings still load, with a warning
    RENAMED: ClassVar[dict[str, str]] = {"batch": "request_size", "max_batch": "max_request_size"}

    env: str = "libero"                     # simulator: libero | metaworld
    suite: str = ""                         # "" = the env's standard suite (libero: libero_object, metaworld: mt)
    tasks: list[int] | None = None          # task ids; None = every task of the suite
    trials: int = 50                        # init states per task: trial = init-state index 0..trials-1
    trial_start: int = 0                    # first init-state index (trials trial_start..trial_start+trials-1)
    policy: str = "zero"                    # registered policy name, package.module:Class (your own policy class:
                                            # docs/models.md) or a directory written by `wamkit export`; with
                                            # server.url the policy that server serves is evaluated (recorded from
                                            # its metadata: summary served_policy)
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
    inprocess_batching: bool = False        # inference=inprocess: merge requests in flight together into one policy
                                            # call (wamkit serve's batcher, idle dispatch, server.max_batch_size and
                                            # server.max_wait_ms), no transport; auto then measures merged shapes
    server: ServerOptions = field(default_factory=ServerOptions)
    mode: Literal["serial", "pipelines", "auto"] = "serial"  # scheduler (docs/evaluation.md); auto: the fastest
    num_envs: int = 1                       # env worker processes (mode=serial uses one, whatever this says)
    request_size: int = 1                   # pipelines: observations per request (B; was `batch`)
    pipelines: int = 1                      # pipelines: number of env groups (P)
    depth: int = 0                          # auto: max requests in flight (0 = chosen from measurements)
    max_request_size: int = 0               # auto: cap on observations per request (0 = the server's max batch
                                            # size; was `max_batch`)
    auto_probe: bool = True                 # auto, with a batching server: run the cost model's plan, "send
                                            # each observation at once", lockstep and halves for a few env cycles
                                            # each, keep the fastest, measure again in the run's tail
                                            # (scheduler.auto_shape)
    auto_shapes: list[str] | None = None    # auto_probe: the shapes it measures (plan, greedy, lockstep, halves;
                                            # None = all four); one shape: auto runs it all along, unprobed
                                            # (e.g. `ROW @ auto_shapes=greedy` beside that shape's fixed row)
    group_by_task: bool | None = None       # order auto's requests by task (None: for SGLang, whose requests the
                                            # client splits per prompt and sends at once)
    run_to_max_steps: bool = False          # the reference's semantics: keep stepping after success
    render_every_step: bool = False         # the single-batch baseline: render every step
    resume: bool = False                    # continue the run in out= (skips episodes already in results.jsonl)
    seed: int = 0                           # env and policy noise seed
    progress: bool = True                   # progress bar with ETA on stderr; where stderr is not a terminal (a
                                            # log file, CI, `| tee`): a plain line every progress_every_s seconds
    progress_every_s: float = 20.0          # ... and one at the end: episodes done, success so far, rates, ETA
    runtime: Literal["local", "ray"] = "local"  # where env workers and servers run (docs/ray.md)
    ray: dict[str, Any] = field(default_factory=dict)  # runtime=ray options, e.g. ray.address=auto (docs/ray.md)
    env_nice: int = 0                       # > 0: the local env workers run at this niceness (1..19, Linux), so that
                                            # the servers' and this process's short host work per request does not
                                            # wait behind simulators for a CPU (core/cpu_pinning.py); 0: as started
    gc_freeze: bool = True                  # freeze the heap setup built before the episodes start (gc.freeze): a
                                            # full garbage collection then walks only what the run allocates
                                            # (core/heap.py; on the GPU machine such collections held every
                                            # env 90-247 ms, once or twice a 30 s row)
    max_episode_retries: int = 3            # re-runs of an episode whose env worker crashed (or stalled)
    # a stalled env worker (hung simulator, SIGSTOP) is killed and restarted, its episode re-run, once a call takes
    # longer than max(env_timeout_min_s, env_timeout_factor x the slowest such call so far); a worker's first reset
    # and first chunk get env_timeout_first_s (see wamkit.eval.scheduler.CallDeadlines)
    env_timeout_min_s: float = 60.0         # floor of a call's deadline (seconds)
    env_timeout_factor: float = 10.0        # deadline = this x the slowest call of its kind so far
    env_timeout_first_s: float = 600.0      # deadline of a worker's first reset and first chunk
    logger: Literal["none", "wandb"] = "none"  # wandb: also log episodes and the summary to Weights & Biases
                                            # (pip install wandb; WANDB_MODE=offline works without an account)
    wandb_project: str = "wamkit"           # the W&B project of logger=wandb (run name: the out= dir's name)

    def __post_init__(self) -> None:
        if not self.suite:
            from wamkit.envs.base import default_suite

            self.suite = default_suite(self.env)

    def env_count(self) -> int:
        """Env worker processes this run uses: serial runs one, whatever num_envs says."""
        return 1 if self.mode == "serial" else self.num_envs

    def server_batch_cap(self, envs: int | None = None) -> int:
        """The most observations one server batch can get from `envs` envs (default: this run's, env_count()): an
        env sends its next observation only once its last one is answered. The servers a run launches start with
        max_batch_size capped at this, so their warm-up captures CUDA graphs only of the batches they can get
        (wam-ref's buckets 1-8 of 1-64 at 8 envs)."""
        return max(1, min(self.server.max_batch_size, self.env_count() if envs is None else envs))

    def validate(self) -> None:
        for key, lo, hi in (("trials", 1, None), ("trial_start", 0, None), ("image_size", MIN_IMAGE, MAX_IMAGE),
                            ("num_envs", 1, 4096), ("request_size", 1, None), ("pipelines", 1, None),
                            ("depth", 0, None),
                            ("max_request_size", 0, None), ("save_videos", 0, None), ("seed", 0, 2**63 - 1),
                            ("max_episode_retries", 0, None), ("env_timeout_factor", 1, None), ("env_nice", 0, 19)):
            check_number(key, getattr(self, key), lo, hi)
        check_number("horizon", self.horizon, 1, none_ok=True)
        check_number("max_steps", self.max_steps, 1, none_ok=True)
        for key in ("env_timeout_min_s", "env_timeout_first_s", "progress_every_s"):
            check_number(key, getattr(self, key), 0, lo_open=True)
        if not str(self.out).strip():   # '' wrote into the current directory, '  ' into a directory of spaces
            raise ConfigError(f"out={self.out!r}: the output directory must be given (e.g. out=runs/my_eval)")
        check_number("server.port", self.server.port, 0, 65535)
        check_number("server.max_batch_size", self.server.max_batch_size, 1)
        check_number("server.max_wait_ms", self.server.max_wait_ms, 0)
        check_number("server.startup_timeout_s", self.server.startup_timeout_s, 0, lo_open=True)
        check_number("server.request_timeout_s", self.server.request_timeout_s, 0, lo_open=True, none_ok=True)
        check_number("server.retries", self.server.retries, 0)
        check_number("server.retry_s", self.server.retry_s, 0)
        if self.auto_shapes is not None:
            from wamkit.eval.shape_probe import SHAPES

            bad = [x for x in self.auto_shapes if x not in SHAPES]
            if bad or not self.auto_shapes or len(set(self.auto_shapes)) != len(self.auto_shapes):
                raise ConfigError(f"auto_shapes={','.join(self.auto_shapes)!r}: one or more of {', '.join(SHAPES)}, "
                                  "each once")
        if self.inprocess_batching and self.inference != "inprocess":
            raise ConfigError("inprocess_batching=true merges requests of inference=inprocess; with inference=server "
                              "the server batches (server.max_batch_size, server.max_wait_ms)")
        if self.mode == "pipelines":
            if self.num_envs < self.pipelines:
                raise ConfigError(f"num_envs ({self.num_envs}) must be >= pipelines ({self.pipelines})")
        if self.server.protocol not in PROTOCOLS:
            raise ConfigError(f"server.protocol={self.server.protocol!r}; valid choices: {', '.join(PROTOCOLS)}")
        if self.server.launch not in LAUNCHERS:
            raise ConfigError(f"server.launch={self.server.launch!r}; valid choices: {', '.join(LAUNCHERS)}")
        if self.server.replicas < 1:
            raise ConfigError(f"server.replicas must be >= 1, got {self.server.replicas}")
        if self.server.replicas > 1 and self.server.port:
            raise ConfigError("server.port must be 0 (pick free ports) when server.replicas > 1")
