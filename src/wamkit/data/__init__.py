"""LeRobot v3 datasets in and out, action representations and normalization, training samples.

Public API: `wamkit.data.LeRobotDataset(root)`, `wamkit.data.LeRobotWriter(root, fps, features)`,
`wamkit.data.transforms` (rot6d, gripper maps, QuantileNormalizer, ActionPipeline), `wamkit.data.samples`."""

from wamkit.data.lerobot import LeRobotDataset  # noqa: F401
from wamkit.data.writer import LeRobotWriter  # noqa: F401
