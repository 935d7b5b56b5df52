"""The error body of every route, HTTP and websocket: one layout, `{"error": {message, type, path, code}, "detail"}`;
the token check of every route (token_accepted); and the size above which a request body or frame is decoded off
the event loop."""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse

AUTH_SCHEMES = ("bearer", "api-key")   # `Authorization: Bearer <token>`, or openpi's `Api-Key <token>` (any case)

OFFLOAD_BYTES = 256 * 1024  # bodies larger than this are decoded in a helper thread, not on the event loop


def error_response(status: int, message: str, path: str = "", headers: dict[str, str] | None = None,
                   kind: str | None = None) -> JSONResponse:
    kind = kind or {401: "authentication_error", 408: "request_timeout", 413: "request_too_large",
                    415: "unsupported_media_type", 503: "server_busy",
                    500: "server_error"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "path": path, "code": status},
                         "detail": message}, status_code=status, headers=headers)


def token_accepted(token: str | None, authorization: str) -> bool:
    """Whether an `Authorization` header carries the server's token (always, when the server has none): one check for
    HTTP and websocket routes. Compared in constant time."""
    if token is None:
        return True
    scheme, _, given = authorization.strip().partition(" ")
    return scheme.lower() in AUTH_SCHEMES and hmac.compare_digest(given.strip().encode(), token.encode())
