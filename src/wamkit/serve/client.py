"""The action client lives in the protocol layer (wamkit.protocol.client), below the policies that use it (the
Cosmos3 adapter); re-exported here for the serving layer's users."""

from wamkit.protocol.client import ActionClient, ActionClientError, SyncActionClient  # noqa: F401
