"""wamkit.protocol: the wire contract of the action API (SGLang-compatible `POST /v1/actions/generations`),
JSON/msgpack body codecs, image payloads, validation (ProtocolError names the field path), and a codec for
requests sent to an SGLang server, and the HTTP client of that contract (wamkit.protocol.client; imported on
demand). Knows nothing of models, envs or servers."""

from wamkit.protocol.codec import MSGPACK, decode_body, encode_body, is_msgpack  # noqa: F401
from wamkit.protocol.errors import ProtocolError  # noqa: F401
from wamkit.protocol.images import decode_image, encode_image  # noqa: F401
from wamkit.protocol.messages import (  # noqa: F401
    DEFAULT_CAMERA, ActionRequest, ActionResponse, Runtime, build_request, build_response, decode_action_values,
    parse_request, parse_response)
from wamkit.protocol.sglang import (  # noqa: F401
    build_sglang_request, check_sglang_request, decode_sglang_response, sglang_parameters)
