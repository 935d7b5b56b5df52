"""Frames of the two websocket action protocols the client speaks, one codec each: what a request frame holds, how a
reply decodes, how a refusal reads, which route and auth scheme the server expects.

- `openpi`: one observation per frame (openpi's observation dict, plus ``seed``), reply ``{"actions": (H, D)}``;
  route /openpi/policy; ``Authorization: Api-Key <key>``.
- `sglang-ws`: SGLang's ``/v1/actions/realtime``: action requests, envelope replies; several observations per frame
  when the server's metadata says ``capabilities.batch_inputs``; ``Authorization: Bearer <token>``. wamkit's own
  request forms (several cameras and states per frame, a list of seeds) go only to a wamkit server (its metadata
  says so); any other server gets SGLang's (wamkit.protocol.sglang.build_sglang_observation_request).
- Error replies: SGLang (both routes) and openpi answer a failed request with a Python traceback (SGLang's
  ``{"error": traceback}``, openpi's text frame): read as its last line (``ValueError: ...``), a client error (400,
  not retried) for ValueError / TypeError / KeyError, as SGLang's HTTP route answers a ValueError with 400, else 500.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from wamkit.core.types import Observation
from wamkit.protocol import parse_response
from wamkit.protocol.openpi import build_ws_request, decode_openpi_actions, observation_to_openpi, packb
from wamkit.protocol.sglang import build_sglang_observation_request

CLIENT_EXCEPTIONS = ("ValueError", "TypeError", "KeyError")   # a traceback ending in one of these: the request's fault


class Refused(Exception):
    """The server answered with an error (status: HTTP-like code; None when the server said nothing more)."""

    def __init__(self, message: str, status: int | None, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


def text_refusal(text: str) -> Refused:
    """An error sent as text (openpi's text frame, SGLang's {"error": traceback}) -> Refused: a Python traceback
    is read as its last line, the exception (400 for CLIENT_EXCEPTIONS, else 500); other text as it is (500)."""
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    if not lines:
        return Refused("the server answered an empty error", 500)
    if not lines[0].startswith("Traceback"):
        return Refused(text.strip()[-2000:], 500)
    last = lines[-1][:500]
    exc = last.split(":", 1)[0].rsplit(".", 1)[-1]
    return Refused(last, 400 if exc in CLIENT_EXCEPTIONS else 500)


def error_reply(reply: Any) -> Refused | None:
    """A reply that reports an error -> Refused (wamkit: the HTTP error body; openpi: a text frame, usually a
    traceback; SGLang: {"error": traceback})."""
    if isinstance(reply, str):
        try:
            reply = json.loads(reply)
        except ValueError:
            return text_refusal(reply)
        if not isinstance(reply, dict):
            return Refused(str(reply)[:2000], 500)
    err = reply.get("error")
    if err is None:
        return None
    if isinstance(err, dict):
        code = err.get("code")
        return Refused(str(err.get("message") or reply.get("detail") or err), int(code) if isinstance(code, int)
                       else 500, err.get("retry_after_s"))
    return text_refusal(str(err))


class OpenpiCodec:
    name = "openpi"
    path = "/openpi/policy"
    auth_scheme = "Api-Key"   # openpi's client sends "Api-Key <key>"; wamkit accepts it and "Bearer <token>"

    def per_frame(self, capabilities: dict[str, Any]) -> int:
        return 1

    def body(self, obs: Sequence[Observation], seeds: Sequence[int], params: dict[str, Any],
             send_seed: bool, native: bool = True) -> tuple[dict[str, Any], str]:
        """(frame body, request id) for one observation (packb makes the frame); the same for any server."""
        return observation_to_openpi(obs[0], seeds[0] if send_seed else None), ""

    def encode(self, obs: Sequence[Observation], seeds: Sequence[int], params: dict[str, Any],
               send_seed: bool, native: bool = True) -> tuple[bytes, str]:
        """(frame, request id) for one observation."""
        body, rid = self.body(obs, seeds, params, send_seed, native)
        return packb(body), rid

    def decode(self, reply: dict[str, Any], raw_action_dim: int | None, n: int) -> tuple[np.ndarray, dict[str, Any]]:
        """(actions (1, H, D), server timing); ProtocolError when the reply is malformed."""
        return decode_openpi_actions(reply, raw_action_dim)[None], dict(reply.get("server_timing") or {})


class SglangWsCodec:
    name = "sglang-ws"
    path = "/v1/actions/realtime"
    auth_scheme = "Bearer"

    def per_frame(self, capabilities: dict[str, Any]) -> int:
        batched = capabilities.get("batch_inputs") and capabilities.get("max_batch_size")
        return int(capabilities["max_batch_size"]) if batched else 1

    def body(self, obs: Sequence[Observation], seeds: Sequence[int], params: dict[str, Any],
             send_seed: bool, native: bool = True) -> tuple[dict[str, Any], str]:
        """native (a wamkit server): wamkit's forms; else SGLang's (the observations share one seed: the client
        planned them with plan_sglang_requests)."""
        if native:
            body = build_ws_request(obs, seeds, params)
        else:
            body = build_sglang_observation_request(obs, seeds[0], params, "array")
        return body, body["request_id"]

    def encode(self, obs: Sequence[Observation], seeds: Sequence[int], params: dict[str, Any],
               send_seed: bool, native: bool = True) -> tuple[bytes, str]:
        body, rid = self.body(obs, seeds, params, send_seed, native)
        return packb(body), rid

    def decode(self, reply: dict[str, Any], raw_action_dim: int | None, n: int) -> tuple[np.ndarray, dict[str, Any]]:
        resp = parse_response(reply, raw_action_dim=raw_action_dim, expect_n=n)
        return resp.actions, {**(reply.get("server_timing") or {}), **(resp.timing or {})}


CODECS = {c.name: c for c in (OpenpiCodec(), SglangWsCodec())}
PROTOCOLS = tuple(CODECS)
DEFAULT_PATHS = {name: c.path for name, c in CODECS.items()}
