"""wamkit.eval layer (see ARCHITECTURE.md)."""
