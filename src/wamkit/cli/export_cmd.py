"""`wamkit export CKPT OUT [weights=auto|ema|model]`: training checkpoint -> directory that `wamkit serve policy=OUT`
and `wamkit eval policy=OUT` load. CKPT: a step dir, a run's checkpoints/ dir or a run dir (newest checkpoint)."""

from __future__ import annotations

from wamkit.core.errors import UserError


USAGE = "usage: wamkit export CKPT_DIR OUT_DIR [weights=auto|ema|model]"


def help_text(argv: list[str]) -> str:
    return (f"{USAGE}\n\n{__doc__.strip()}\n\nweights=auto  [auto|ema|model] auto: the EMA weights when the run "
            "kept them (ema > 0), else the model's")


def resolve_manifest_class(ckpt: str) -> None:
    """The class CKPT's policy.json names, resolved as any manifest on disk is (a checkpoint may be a colleague's or
    downloaded: its module is imported from sys.path only, never from the checkpoint's own files, and named in a
    logged line; wamkit.policies.catalog.manifest_policy_class) before the export builds the policy by that name."""
    from wamkit.policies.catalog import manifest_policy_class
    from wamkit.policies.manifest import CHECKPOINT_MANIFEST, PolicyManifest
    from wamkit.train.checkpoint import resolve_checkpoint

    step_dir = resolve_checkpoint(ckpt)
    manifest = step_dir / CHECKPOINT_MANIFEST
    if manifest.exists():   # (a missing one: export_checkpoint says so)
        try:
            manifest_policy_class(PolicyManifest.read(manifest).policy, manifest)
        except UserError as e:
            raise UserError(f"{step_dir}: {e}") from None


def main(argv: list[str]) -> int:
    from wamkit.train.export import export_checkpoint

    pos = [a for a in argv if "=" not in a]
    kv = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = set(kv) - {"weights"}
    if len(pos) != 2 or unknown:
        raise UserError(USAGE)
    resolve_manifest_class(pos[0])
    out = export_checkpoint(pos[0], pos[1], weights=kv.get("weights", "auto"))
    print(f"exported {pos[0]} -> {out}")
    return 0
