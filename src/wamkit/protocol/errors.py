"""The one error of the protocol layer: a malformed message, naming the offending field path."""

from __future__ import annotations

from wamkit.core.errors import UserError

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
