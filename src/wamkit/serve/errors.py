"""The error body of every route, HTTP and websocket: one layout, `{"error": {message, type, path, code}, "detail"}`;
what a 500 tells of the exception behind it (failure_message); the token check of every route (token_accepted); and
the size above which a request body or frame is decoded off the event loop."""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse

from wamkit.protocol.errors import public_text

AUTH_SCHEMES = ("bearer", "api-key")   # `Authorization: Bearer <token>`, or openpi's `Api-Key <token>` (any case)

OFFLOAD_BYTES = 256 * 1024  # bodies larger than this are decoded in a helper thread, not on the event loop


def error_response(status: int, message: str, path: str = "", headers: dict[str, str] | None = None,
                   kind: str | None = None) -> JSONResponse:
    kind = kind or {401: "authentication_error", 403: "permission_error", 408: "request_timeout",
                    413: "request_too_large", 415: "unsupported_media_type", 503: "server_busy",
                    500: "server_error"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "path": path, "code": status},
                         "detail": message}, status_code=status, headers=headers)


def failure_message(e: BaseException) -> str:
    """The message of a 500: the exception's type and text, without the server's absolute paths or object addresses
    (a policy's error may name its weights' path; the server's log has the whole text and traceback)."""
    return f"{type(e).__name__}: {public_text(str(e))}"


def token_accepted(token: str | None, authorization: str) -> bool:
    """Whether an `Authorization` header carries the server's token (always, when the server has none): one check for
    HTTP and websocket routes. Compared in constant time."""
    if token is None:
        return True
    scheme, _, given = authorization.strip().partition(" ")
    return scheme.lower() in AUTH_SCHEMES and hmac.compare_digest(given.strip().encode(), token.encode())
