"""wamkit.serve layer (see ARCHITECTURE.md)."""
