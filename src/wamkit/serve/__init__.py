"""wamkit.serve: the action server (`wamkit serve`: Starlette + uvicorn, dynamic batcher), server workers that
launch / health-check / stop a server process (wamkit's own or `sglang serve`), and the async action client.
The app itself lives in wamkit.serve.app (create_app)."""

from wamkit.protocol.client import ActionClient, ActionClientError, SyncActionClient  # noqa: F401
from wamkit.serve.config import ServeConfig  # noqa: F401
from wamkit.serve.workers import (  # noqa: F401
    ServerConfigError, ServerIdentityError, ServerStartError, ServerWorker, SGLangServerWorker, WamkitServerWorker,
    free_port)
