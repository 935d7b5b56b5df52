"""wam-ref: the reference World Action Model (Qwen3-VL understanding tower + flow-matching generation tower)."""

from wamkit.policies.wam_ref.policy import WamRefPolicy  # noqa: F401
from wamkit.policies.wam_ref.sizes import SIZES, size_names  # noqa: F401
