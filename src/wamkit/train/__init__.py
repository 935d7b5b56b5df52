"""wamkit.train layer (see ARCHITECTURE.md)."""
