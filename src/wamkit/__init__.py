"""wamkit: World Action Models from integration to results (fine-tune, serve, evaluate, scale out)."""

__version__ = "0.1.0"
