"""wamkit.runtime layer (see ARCHITECTURE.md)."""
