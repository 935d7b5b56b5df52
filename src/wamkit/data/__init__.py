"""wamkit.data layer (see ARCHITECTURE.md)."""
