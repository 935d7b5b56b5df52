"""wamkit.protocol layer (see ARCHITECTURE.md)."""
