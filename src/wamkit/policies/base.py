"""The policy contracts, in one file: a batch of observations in, a batch of action chunks out.

- `Policy` (ABC): every policy. `predict(observations, seeds)` returns float32 actions (N, horizon, action_dim) in
  the *environment's* action space (denormalization, rot6d -> axis-angle, gripper mapping are the policy's job).
  Determinism: the result for observation i depends only on (observation i, seeds[i]) and the weights, never on
  which other observations share the batch; schedulers rely on this for schedule-invariant results.
  `spec` says what the policy consumes and produces (it travels with exported checkpoints); `config_class` is the
  dataclass of its options (`config`), next to its code: `make_policy` / `wamkit VERB policy_args.k=v` refuse any
  other key.
- `RemoteCodec`: a policy whose model runs behind another server (Cosmos3 behind SGLang) returns one from
  `remote_codec()`; the caller (the evaluation's server inference) runs encode -> its asynchronous transport ->
  decode, so pre- and post-processing run in the evaluation process and several requests can be in flight.
- `ExportablePolicy` / `TrainablePolicy` (Protocols): what `wamkit export` and `wamkit train` need beyond `Policy`;
  `missing_members(policy, TrainablePolicy)` names what a class lacks. `InitAfterSharding` (optional): torchtitan's
  build order (build on the meta device, shard, then initialize on each rank's device).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Sequence, TypeVar, runtime_checkable

import numpy as np

from wamkit.core.config import build_options, check_number
from wamkit.core.types import Observation

if TYPE_CHECKING:
    import torch

    from wamkit.data.transforms import ActionPipeline

C = TypeVar("C")


@dataclass(frozen=True)
class InputSpec:
    cameras: tuple[str, ...] = ()      # camera keys read from Observation.images ("" = any/none needed)
    image_size: int = 0                # square side the policy resizes to (0 = any)
    state_dim: int = 0                 # 0 = no proprio state used
    text: bool = False                 # uses the task text


@dataclass(frozen=True)
class ActionSpec:
    dim: int = 7                       # action dim in the env's action space
    horizon: int = 16                  # actions per chunk
    representation: str = "env"        # what the model outputs internally (e.g. "rot6d10"); predict() returns env space


@dataclass(frozen=True)
class PolicySpec:
    name: str
    input: InputSpec = field(default_factory=InputSpec)
    action: ActionSpec = field(default_factory=ActionSpec)
    deterministic: bool = True         # same (obs, seed) -> same chunk
    trainable: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PolicySpec":
        return cls(name=d["name"], input=InputSpec(**{**d.get("input", {}),
                                                       "cameras": tuple(d.get("input", {}).get("cameras", ()))}),
                   action=ActionSpec(**d.get("action", {})), deterministic=d.get("deterministic", True),
                   trainable=d.get("trainable", False), extra=dict(d.get("extra", {})))


class RemoteCodec(abc.ABC):
    """Pre/post-processing of a policy served by another server, around a transport the caller owns."""

    protocol: str = "sglang"           # the wire form the server speaks (wamkit.protocol.client mode)
    camera: str = "image"              # the one camera key of the encoded observations
    raw_action_dim: int = 0            # channels of the model's output kept from each response
    server_normalizes: bool = False    # the server returns denormalized actions (it was started with action stats)
    # the policy's own transport options, used by an evaluation's client where server.* names none: token,
    # timeout_s, max_request_size (cosmos3's policy_args of the same names)
    transport: Mapping[str, Any] = MappingProxyType({})

    @abc.abstractmethod
    def parameters(self) -> dict[str, Any]:
        """Request parameters (without the seed)."""

    @abc.abstractmethod
    def encode(self, observations: Sequence[Observation]) -> list[Observation]:
        """Env observations -> what is sent (e.g. one side-by-side image and the prompt)."""

    def seeds(self, seeds: Sequence[int]) -> list[int]:
        """The seed each observation is sent with (default: its own)."""
        return [int(s) for s in seeds]

    @abc.abstractmethod
    def decode(self, values: np.ndarray) -> np.ndarray:
        """(N, H, >= raw_action_dim) server output -> (N, H, action_dim) float32 env actions."""


@dataclass(frozen=True)
class ChunkConfig:
    """The options every action-chunk policy shares; a policy's config subclasses it (or declares its own)."""

    action_dim: int = 7                # env action dimension (the last axis predict returns)
    horizon: int = 16                  # actions per chunk

    def validate(self) -> None:
        check_number("action_dim", self.action_dim, lo=1)
        check_number("horizon", self.horizon, lo=1)


class Policy(abc.ABC):
    name: ClassVar[str]                # registry name (catalog.py); also spec.name
    config_class: ClassVar[type]       # the dataclass of its options (make_policy refuses any other key)
    config: Any                        # its options, an instance of config_class
    spec: PolicySpec

    @classmethod
    def make_config(cls, config: C | None = None, **kwargs) -> C:
        """`config` (or the defaults) with `kwargs` on top, checked and coerced by wamkit.core.config's rules: an
        unknown key is a ConfigError naming it and the valid keys; CLI strings become the field types."""
        return build_options(cls.config_class, kwargs, config, kind="policy_args",
                             name=getattr(cls, "name", "") or cls.__name__)

    @abc.abstractmethod
    def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        """(N, horizon, action_dim) float32 action chunks, one per observation, in the env's action space.

        N = len(observations); horizon and action_dim are spec.action's. What callers accept (policies/checks.py,
        the same rule in `wamkit serve` and in-process evaluation): a float numpy array (another float dtype or a
        torch tensor is converted), finite, of that shape; a longer chunk is cut to the horizon, a shorter one, another
        action dim, NaN/inf or a non-float dtype is refused, naming the policy. The observations' arrays may be
        read-only: copy before changing them."""

    def sft_loss(self, batch: dict[str, Any]):
        from wamkit.core.errors import UserError

        raise UserError(f"policy {self.spec.name!r} is not trainable")

    def max_batch_size(self) -> int:
        """Largest batch predict() should get at once (servers and schedulers respect it)."""
        return 64

    def replica(self) -> "Policy":
        """A second handle on this policy whose predict may run at the same time as this one's, from another thread
        (the server's concurrent_batches > 1): the same weights, its own per-call state. Default: refused, since a
        policy is not assumed to be safe to call from two threads at once."""
        from wamkit.core.errors import UserError

        raise UserError(f"policy {self.spec.name!r} cannot compute two batches at once (concurrent_batches > 1 "
                        f"needs a policy with replica(), e.g. wam-ref, random, fixed-cost)")

    def remote_codec(self) -> RemoteCodec | None:
        """How to reach this policy's model on another server (see RemoteCodec); None: predict() is all there is."""
        return None

    def warmup(self, max_batch_size: int | None = None) -> dict[str, float]:
        """One-off work before the first real call (e.g. capturing CUDA graphs for every batch size up to
        max_batch_size); servers call it before they report healthy. Returns seconds per step; default: nothing to do."""
        return {}

    def close(self) -> None:  # noqa: B027
        pass


# ---- what exporting and training need beyond Policy ---------------------------------------------------------------

@runtime_checkable
class ExportablePolicy(Protocol):
    """What `wamkit export` (wamkit.policies.export.save_exported) writes; loading rebuilds the policy by registry
    name from `export_config()` and loads `module`'s weights strictly. Optional: `save_tokenizer(dir) -> dict` (extra
    files, merged into the config)."""

    spec: PolicySpec                   # spec.name must be a registered policy name
    action_pipeline: ActionPipeline    # env <-> model actions (wamkit.data.transforms), saved with the weights

    @property
    def module(self) -> torch.nn.Module:
        """The network holding every weight (its state_dict is what is saved and loaded)."""

    def export_config(self) -> dict[str, Any]:
        """JSON-able constructor options that rebuild the same network (keys of the policy's config_class)."""


@runtime_checkable
class TrainablePolicy(ExportablePolicy, Protocol):
    """What `wamkit train` needs (wamkit.train.trainer), besides `spec.trainable`; the batch is the one
    wamkit.data.samples collates (docs/CONTRACTS.md)."""

    def fsdp_units(self) -> list[torch.nn.Module]:
        """Blocks to `fully_shard` one by one, the root (`module`) last."""

    def lr_multipliers(self) -> dict[str, float]:
        """{parameter-name glob: learning-rate multiplier}; parameters matching none get 1."""

    def sft_loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        """(scalar loss tensor, metrics) of one training batch. A metric may be a 0-d tensor on the device (the
        trainer sums those on the device and reads them once per log window: no host sync every step)."""


@runtime_checkable
class InitAfterSharding(Protocol):
    """Optional, on a TrainablePolicy class: torchtitan's build order. The trainer builds the policy with
    device="meta" when `can_init_after_sharding(policy_args)`, shards it, then calls `init_weights(device)` on each
    rank (no rank materializes the whole model)."""

    @classmethod
    def can_init_after_sharding(cls, args: dict[str, Any]) -> bool:
        """Whether these options allow it (e.g. not when pretrained weights are loaded at construction)."""

    def init_weights(self, device: torch.device) -> None:
        """Materialize the (sharded) parameters on `device` and initialize them."""


def contract_members(contract: type) -> list[str]:
    """The members a Protocol above declares (its own and its bases'), in declaration order."""
    names: list[str] = []
    for klass in reversed(contract.__mro__):
        if not getattr(klass, "_is_protocol", False) or klass is Protocol:
            continue
        for n in [*klass.__dict__.get("__annotations__", {}), *klass.__dict__]:
            if not n.startswith("_") and n not in names:
                names.append(n)
    return names


def missing_members(obj: Any, contract: type) -> list[str]:
    """The members of `contract` that `obj` (a policy or its class) lacks, in declaration order."""
    return [n for n in contract_members(contract) if not hasattr(obj, n)]
