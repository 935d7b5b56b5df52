"""The export directory: what `make_policy(<dir>)`, `wamkit serve policy=<dir>` and `wamkit eval policy=<dir>` load.

    <dir>/wamkit_policy.json    the policy manifest (`manifest.py`): {"format": "wamkit.policy", "version": 1,
                                "policy": <built-in name or package.module:Class>, "config": <constructor kwargs>,
                                "spec": ..., "files": {...}}
    <dir>/model.safetensors     `policy.module.state_dict()` (safetensors only: no pickle is ever loaded)
    <dir>/action_pipeline.json  `policy.action_pipeline.to_dict()` (steps + normalizer stats)
    (<dir>/tokenizer/           only when the policy uses a local Hugging Face tokenizer)

A policy is exportable when it implements `wamkit.policies.base.ExportablePolicy`. The manifest names a built-in
policy by its registry name and any other class by `package.module:Class` (a name registered with register_policy
exists only in the process that registered it), so every process that can import that module from its sys.path can
load the directory (catalog.manifest_policy_class: an export may come from anyone, so its module is never looked for
in the current directory nor imported from the export's own files). Loading rebuilds the
policy from its `export_config()` plus overrides (`device=`, `num_inference_steps=`...; the common keys
action_dim / horizon / device are dropped where the class takes none), then loads the weights strictly. An override
of one of the class's `architecture_keys` (wam-ref: size, und_config, ...) to another value than the saved one is
refused: the saved weights fix the network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wamkit.core.errors import UserError
from wamkit.policies.base import ExportablePolicy, missing_members
from wamkit.policies.catalog import (BUILTIN, class_target, construct, import_target, is_import_target,
                                     manifest_policy_class, policy_class, policy_names, policy_target)
from wamkit.policies.manifest import EXPORT_MARKER, PolicyManifest, read_export_manifest

WEIGHTS = "model.safetensors"
PIPELINE = "action_pipeline.json"


def _state_dict_for_safetensors(module) -> dict[str, Any]:
    """CPU, contiguous tensors; tensors that share storage are cloned (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for k, v in module.state_dict().items():
        t = v.detach()
        if t.device.type == "meta":
            raise UserError(f"cannot export parameter {k!r}: it lives on the meta device (materialize it first)")
        t = t.to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[k] = t
    return out


def save_exported(policy, directory) -> Path:
    """Write `policy` as an export directory (created if needed; files overwritten). Returns the directory."""
    from safetensors.torch import save_file

    missing = missing_members(policy, ExportablePolicy)
    if missing:
        raise UserError(f"policy {type(policy).__name__} cannot be exported: it has no "
                        f"{', '.join(f'`{m}`' for m in missing)} (wamkit.policies.base.ExportablePolicy)")
    name = manifest_policy(policy)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    config = dict(policy.export_config())
    extra_files = policy.save_tokenizer(d) if hasattr(policy, "save_tokenizer") else {}
    config.update(extra_files)
    save_file(_state_dict_for_safetensors(policy.module), str(d / WEIGHTS), metadata={"format": "pt"})
    policy.action_pipeline.save(d / PIPELINE)
    PolicyManifest(policy=name, config=config, spec=policy.spec.to_dict(),
                   files={"weights": WEIGHTS, "action_pipeline": PIPELINE, **extra_files}).write(d / EXPORT_MARKER)
    return d


def manifest_policy(policy) -> str:
    """What an export's manifest calls `policy`'s class: its built-in name when spec.name is one for this very class,
    else `package.module:Class` (importable by every process; a registered custom name is not). UserError for a class
    that no other process can import (defined in a script run as __main__, or inside a function)."""
    cls = type(policy)
    name = getattr(getattr(policy, "spec", None), "name", None)
    if name in BUILTIN and policy_target(name) == name and policy_class(name) is cls:
        return name
    target = policy_target(name) if name in policy_names() else class_target(cls)
    if is_import_target(target):
        try:
            if import_target(target) is cls:
                return target
        except UserError:
            pass
    target = class_target(cls)
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__ or not is_import_target(target):
        raise UserError(f"policy {cls.__name__} cannot be exported: its class is defined in "
                        f"{'a script run as __main__' if cls.__module__ == '__main__' else 'a function'}, so no "
                        f"other process could import it to load the export; move it into a module")
    return target


def load_exported(directory, **overrides):
    """Rebuild the exported policy: registry name + saved config (+ overrides, e.g. device="cuda",
    num_inference_steps=5), the saved action pipeline, then the weights (strict; safetensors only)."""
    from safetensors.torch import load_file

    from wamkit.data.transforms import ActionPipeline

    d = Path(directory)
    meta = read_export_manifest(d)
    cfg = dict(meta.config)
    if cfg.get("tokenizer_dir"):
        cfg["tokenizer_dir"] = str(d / cfg["tokenizer_dir"])
    files = meta.files
    if "action_pipeline" not in overrides:
        pipe_file = d / files.get("action_pipeline", PIPELINE)
        if "action_pipeline" in files and not pipe_file.exists():   # served actions would not be denormalized
            raise UserError(f"{d}: {pipe_file.name}, named in {EXPORT_MARKER}, is missing (export again)")
        overrides["action_pipeline"] = ActionPipeline.load(pipe_file) if pipe_file.exists() else None
    try:
        cls = manifest_policy_class(meta.policy, d / EXPORT_MARKER)   # its module: never from the directory itself
    except UserError as e:
        if is_import_target(meta.policy) or "unknown policy" not in str(e):
            raise UserError(f"{d}: {e}") from None
        raise UserError(f"{d}: its {EXPORT_MARKER} names policy {meta.policy!r}, which is not a built-in policy "
                        f"nor registered in this process: write its class there as \"package.module:Class\" "
                        f"(exports written now do)") from None
    fixed = [k for k in getattr(cls, "architecture_keys", ()) if k in overrides and k in cfg
             and overrides[k] != cfg[k] and str(overrides[k]) != str(cfg[k])]
    if fixed:
        raise UserError(f"{d}: {', '.join(f'{k}={overrides[k]!r}' for k in fixed)} would change the exported "
                        f"network (saved: {', '.join(f'{k}={cfg[k]!r}' for k in fixed)}); an export's architecture "
                        f"is fixed by its weights: override runtime options only (device, num_inference_steps...)")
    cfg.update(overrides)
    policy = construct(cls, meta.policy, cfg)
    wfile = d / files.get("weights", WEIGHTS)
    if not wfile.exists():
        raise UserError(f"{d}: weights file {wfile.name} is missing")
    module = policy.module
    try:
        state = load_file(str(wfile), device="cpu")
    except Exception as e:  # noqa: BLE001 - SafetensorError (truncated, not safetensors) or OSError
        raise UserError(f"{wfile} is corrupt or incomplete ({type(e).__name__}: {str(e).splitlines()[0]}); "
                        f"export again") from None
    try:
        missing, unexpected = module.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatch: an override changed the architecture
        raise UserError(f"{d}: weights do not fit the rebuilt policy (did an override change its shape?): "
                        f"{str(e).splitlines()[0]}") from None
    if missing or unexpected:
        raise UserError(f"{d}: weights do not match the rebuilt policy: missing {missing[:5]}, "
                        f"unexpected {unexpected[:5]}")
    module.eval()
    return policy
