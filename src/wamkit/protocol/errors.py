"""The one error of the protocol layer: a malformed message, naming the offending field path; and public_text, what
an error message may tell a client of the server's internals."""

from __future__ import annotations

import re

from wamkit.core.errors import UserError

# an absolute path's directories ('/home/me/runs/' of '/home/me/runs/x.pt'; not a URL's '//host/'), and an object's
# default repr ('<_io.BytesIO object at 0x7fd7...>')
_ABS_DIRS = re.compile(r"(?<![\w./:-])/(?:[^/\s'\"<>:]+/)+")
_OBJECT_REPR = re.compile(r"<([\w.]+) object at 0x[0-9a-fA-F]+>")
MAX_PUBLIC_CHARS = 500


def public_text(text: str) -> str:
    """An exception's text as a client may see it: absolute paths cut to their last part (.../x.pt), object reprs to
    their type (<BytesIO>), at most MAX_PUBLIC_CHARS characters. The server logs the full text."""
    text = _OBJECT_REPR.sub(lambda m: f"<{m.group(1).rsplit('.', 1)[-1]}>", text)
    text = _ABS_DIRS.sub(".../", text)
    return text if len(text) <= MAX_PUBLIC_CHARS else text[:MAX_PUBLIC_CHARS] + "..."

# error.type of a 500 whose cause is the policy's unusable answer (wrong shape, NaN): the same request fails the same
# way again, so a client does not retry it
POLICY_OUTPUT_ERROR = "policy_output_error"


class ProtocolError(UserError):
    """A request/response that does not follow the action API contract.

    path:   dotted field path with list indices, e.g. ``input.image[3].shape`` ("" = the whole body).
    status: the HTTP status a server answers with (400 malformed, 413 too large, 415 bad content type, 422 valid
            but unsupported by this server).
    """

    def __init__(self, path: str, message: str, status: int = 400):
        self.path = path
        self.message = message
        self.status = status
        super().__init__(f"{path}: {message}" if path else message)

    def to_dict(self) -> dict:
        return {"error": {"message": str(self), "type": "invalid_request_error", "path": self.path,
                          "code": self.status},
                "detail": str(self)}
