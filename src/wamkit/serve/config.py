"""ServeConfig: everything `wamkit serve` takes (YAML and/or key=value overrides via wamkit.core.config)."""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from wamkit.core.config import check_number
from wamkit.core.errors import ConfigError, unknown_choice
from wamkit.protocol.limits import DecodeLimits

_D = DecodeLimits()
log = logging.getLogger("wamkit.serve")
TOKEN_ENV = "WAMKIT_TOKEN"            # the token from the environment (not on the command line, where ps shows it)
INSTANCE_ENV = "WAMKIT_INSTANCE_ID"   # set by WamkitServerWorker (random per start); echoed by /health and metadata


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1); anything else may be reachable from outside."""
    if host.strip().lower() in ("localhost", "localhost.", "ip6-localhost", "ip6-loopback"):
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)   # ::ffff:127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def http_url(host: str, port: int) -> str:
    """http://host:port, an IPv6 address in brackets (http://[::1]:8000)."""
    h = host.strip()
    return f"http://[{h}]:{port}" if ":" in h and not h.startswith("[") else f"http://{h}:{port}"


_MAX_MB = float(2 ** 20)   # sizes in MB stay below 1 TiB: int(mb * 2**20) must be a sane byte count
# (key, lowest, highest, lowest excluded) of every number of ServeConfig, checked by validate()
_NUMBER_RANGES = (
    ("port", 0, 65535, False), ("max_batch_size", 0, None, False), ("max_wait_ms", 0, 60000, False),
    ("max_wait_fraction", 0, 1, False), ("concurrent_batches", 1, None, False), ("decode_threads", 1, None, False),
    ("max_queue", 1, None, False), ("max_body_mb", 0, _MAX_MB, True), ("log_every_s", 0, None, False),
    ("graceful_timeout_s", 0, None, False), ("parent_pid", 0, 2 ** 31 - 1, False), ("torch_threads", 0, None, False),
    ("max_image_pixels", 1, None, False), ("max_decoded_mb", 0, _MAX_MB, True), ("max_depth", 1, None, False),
    ("max_text_chars", 1, None, False), ("header_timeout_s", 0, None, True), ("body_timeout_s", 0, None, True),
    ("keep_alive_timeout_s", 0, None, True), ("max_connections", 1, None, False), ("max_header_kb", 1, None, False),
    ("max_containers", 1, None, False), ("max_inflight_decoded_mb", 0, _MAX_MB, False),
    ("min_body_kb_per_s", 0, None, False), ("ws_idle_timeout_s", 0, None, False),
)


@dataclass
class ServeConfig:
    policy: str = "random"                  # registered name or a directory written by `wamkit export`
    policy_args: dict[str, Any] = field(default_factory=dict)  # policy constructor keys, e.g. policy_args.size=tiny
    host: str = "127.0.0.1"                 # loopback by default; any other host needs a token (or allow_insecure)
    allow_insecure: bool = False            # serve a non-loopback host without a token (trusted networks only)
    port: int = 8000                        # TCP port (0: pick a free one)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # the policy's device unless policy_args.device says; auto: GPU
                                            # when present
    max_batch_size: int = 0                 # the most observations one policy.predict call gets (metadata:
                                            # capabilities.max_batch_size); 0: the policy's max_batch_size()
    max_wait_ms: float = 5.0                # how long a batch may wait to fill up (from its oldest observation)
    max_wait_fraction: float = 0.0          # refill: after a batch, a partial batch waits up to this fraction of the
                                            # batch time for the clients just answered (closed-loop clients: 0.25;
                                            # 0: off; docs/serving.md "Batching")
    idle_dispatch: bool = False             # when no batch computes and no other request is being received, run
                                            # a partial batch at once instead of waiting max_wait_ms (continuous
                                            # batching; a lone/lockstep client saves max_wait_ms a request)
    concurrent_batches: int = 1             # batches computing at once, each on its own policy replica (wam-ref:
                                            # its own CUDA graphs and stream, the weights shared): a GPU that one
                                            # small batch leaves mostly idle overlaps them (docs/serving.md)
    policy_process: bool = False            # run the policy in a child process: its host work (CUDA launches) and
                                            # the event loop (HTTP, decoding, batching) then never share one GIL
    decode_threads: int = 2                 # threads decoding request bodies over 256 KB off the event loop (PNG
                                            # decoding runs in parallel; JSON/base64 parsing holds the GIL)
    max_queue: int = 1024                   # observations waiting; beyond that 503 + Retry-After
    shm_arrays: bool = False                # websocket clients on this host may send arrays by reference into
                                            # their shared-memory files (wamkit.protocol.shm; loopback connections
                                            # only; `wamkit eval` turns it on for the servers it starts itself)
    max_body_mb: float = 64.0               # request body cap (413 beyond)
    token: str | None = None                # bearer token (visible in `ps`: prefer token_file or env WAMKIT_TOKEN);
                                            # None: token_file, else env WAMKIT_TOKEN, else no auth
    token_file: str | None = None           # a file holding the token (first line; keep it chmod 600)
    log_every_s: float = 10.0               # one-line metrics summary to stderr (0: off)
    log_level: str = "warning"              # uvicorn's log level
    model_name: str | None = None           # the `model` field of responses (default: the policy name)
    graceful_timeout_s: float = 60.0        # on SIGTERM: wait this long for in-flight work
    parent_pid: int = 0                     # exit when this process dies (server workers set it)
    warmup: bool = True                     # policy.warmup(max batch) before /health answers (e.g. CUDA graphs)
    torch_threads: int = 0                  # torch intra-op threads of the server; 0: min(4, its CPUs) (the cores
                                            # belong to env workers: a large OpenMP team on busy cores stalls)
    # limits of what one request may make the server decode (413/400 naming the field beyond them)
    max_image_pixels: int = _D.max_image_pixels   # per image (4096 x 4096), checked on the declared size/PNG header
    max_decoded_mb: float = _D.max_decoded_bytes / 2 ** 20  # all images of one request, decoded (256)
    max_depth: int = _D.max_depth           # nesting of mappings/lists in a body
    max_text_chars: int = _D.max_text_chars  # each task/prompt and the request_id
    max_containers: int = _D.max_containers  # mappings + lists in one body or frame (numbers not counted): 413
                                            # beyond, counted before they are built
    max_inflight_decoded_mb: float = 0.0    # decoded images of all requests queued or computing, together: 503 +
                                            # Retry-After beyond; 0: 4 x max_decoded_mb
    # browsers: a page on any site may send requests to this server (docs/serving.md "Limits and security")
    allowed_origins: list[str] = field(default_factory=list)  # websocket handshakes carrying an Origin header are
                                            # refused (403) unless it is listed (e.g. http://localhost:3000; *: any);
                                            # clients that send none (openpi, websockets, wamkit) are not affected
    allowed_hosts: list[str] = field(default_factory=list)  # bound to loopback, requests whose Host header is not
                                            # localhost / 127.x / [::1] are refused (DNS rebinding): names added here
                                            # are accepted too (*: any)
    # slow or idle clients (connection-level; see docs/serving.md "Limits and security")
    header_timeout_s: float = 10.0          # a request's headers must arrive within this, else the socket is closed
    body_timeout_s: float = 60.0            # a request's body must arrive within this, else 408 and close
    keep_alive_timeout_s: float = 5.0       # idle keep-alive connections are closed after this
    max_connections: int = 512              # open connections; beyond it the oldest one still sending headers is
                                            # dropped, else a body slower than min_body_kb_per_s (never more than
                                            # the process's file limit allows)
    max_header_kb: int = 16                 # request line + headers still incomplete in h11's buffer (400 beyond)
    min_body_kb_per_s: float = 64.0         # at the connection cap, a body arriving slower than this on average is
                                            # dropped before a new connection is (0: bodies are never dropped)
    ws_idle_timeout_s: float = 0.0          # a websocket without a frame for this long is closed (1000; 0: never)

    def validate(self) -> None:
        """Every number finite and in range (inf or NaN passed `x > 0` checks and hung requests or overflowed
        int(); core.config.check_number), log_level one of uvicorn's, the bind/token rule."""
        for key, lo, hi, lo_open in _NUMBER_RANGES:
            check_number(key, getattr(self, key), lo, hi, lo_open=lo_open)
        if self.concurrent_batches > 1 and self.policy_process:
            raise ConfigError("concurrent_batches > 1 runs the policy's replicas in threads of this process: it "
                              "cannot be combined with policy_process=true")
        from uvicorn.config import LOG_LEVELS   # uvicorn's levels (it raises KeyError on any other)

        if self.log_level not in LOG_LEVELS:
            raise unknown_choice("log_level", self.log_level, LOG_LEVELS)
        if self.token and self.token_file:
            raise ConfigError("set token or token_file, not both")
        if self.max_inflight_decoded_mb and self.max_inflight_decoded_mb < self.max_decoded_mb:
            raise ConfigError(f"max_inflight_decoded_mb={self.max_inflight_decoded_mb:g} is below max_decoded_mb="
                              f"{self.max_decoded_mb:g}: a request within max_decoded_mb would never fit")
        if self.token_file:
            read_token_file(self.token_file)   # a missing or empty file: one line, before any warning
            warn_if_shared(self.token_file)
        if not is_loopback(self.host) and not self.resolved_token() and not self.allow_insecure:
            raise ConfigError(f"host={self.host} is not a loopback address and no token is set: anyone who reaches "
                              f"it could use the server; set env {TOKEN_ENV} (or token_file=), or allow_insecure=true "
                              f"on a trusted network")

    def decode_limits(self) -> DecodeLimits:
        return DecodeLimits(max_depth=self.max_depth, max_image_pixels=self.max_image_pixels,
                            max_decoded_bytes=int(self.max_decoded_mb * 2 ** 20), max_text_chars=self.max_text_chars,
                            max_observations=self.max_queue, max_containers=self.max_containers)

    def inflight_decoded_bytes(self) -> int:
        """max_inflight_decoded_mb in bytes (0: 4 x max_decoded_mb)."""
        return int((self.max_inflight_decoded_mb or 4 * self.max_decoded_mb) * 2 ** 20)

    def resolved_token(self) -> str | None:
        """token, else the first line of token_file, else env WAMKIT_TOKEN; None: no auth."""
        if self.token:
            return self.token
        if self.token_file:
            return read_token_file(self.token_file)
        return os.environ.get(TOKEN_ENV) or None


def read_token_file(path: str) -> str:
    """The token in `path` (its first line, stripped); ConfigError, one line, when it is missing or empty."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            token = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"token_file={path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not token:
        raise ConfigError(f"token_file={path}: the file is empty (its first line must hold the token)")
    return token


def warn_if_shared(path: str) -> None:
    """One warning line when the token file's group or anyone may read or change it."""
    try:
        mode = os.stat(os.path.expanduser(path)).st_mode
    except OSError:
        return   # read_token_file names the problem
    if mode & 0o077:
        log.warning("token_file=%s: other users may read or change it (mode %o); chmod 600 it", path, mode & 0o777)
