"""Policy names -> their classes: the one resolver every verb uses (train, serve, eval, export, data record).

A policy is named by
- a registered name (`zero`, `wam-ref`, ..., or one added with `register_policy(name, "package.module:Class")`),
- `package.module:Class` (any importable class: a module on PYTHONPATH or in the current directory), or
- a directory written by `wamkit export` (`registry.make_policy` loads those; see `manifest.py`).

A class named by a manifest on disk (an export's or a checkpoint's, which may come from anyone) is resolved by
`manifest_policy_class`: its module is imported only from sys.path as it stands (the current directory is not added)
and never from files inside the manifest's directory; importing one that is not wamkit's own logs one line.

Every class is checked when it is resolved (`check_policy_class`): a bad path, a missing attribute, something that
is not a policy class, or a Policy subclass that leaves `predict` abstract is one line (UserError) naming it.
`construct` builds one from keyword options (a `config_class` dataclass, or the keyword parameters of `__init__`),
and `check_built` checks the instance (its `spec`).

The bottom of the policy factory: `export.py` (rebuilds an exported policy) and `registry.py` (`make_policy`) both
read it; it imports neither.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import sys
from pathlib import Path
from typing import Any

from wamkit.core.errors import ConfigError, UserError, unknown_choice

log = logging.getLogger(__name__)

# the policies wamkit ships (register_policy refuses to replace one of these unless override=True)
BUILTIN: dict[str, str] = {
    "zero": "wamkit.policies.simple:ZeroPolicy",
    "random": "wamkit.policies.simple:RandomPolicy",
    "metaworld-expert": "wamkit.policies.metaworld_expert:MetaWorldExpertPolicy",
    "wam-ref": "wamkit.policies.wam_ref.policy:WamRefPolicy",
    "cosmos3": "wamkit.policies.cosmos3.policy:Cosmos3Policy",
    "cosmos3-standin": "wamkit.policies.cosmos3.standin:Cosmos3StandIn",
    "fixed-cost": "wamkit.policies.simple:FixedCostPolicy",
}
_REGISTRY: dict[str, str] = dict(BUILTIN)

# what evaluation, serving and training pass to every policy (a policy ignores those it does not take)
COMMON_KWARGS = ("action_dim", "horizon", "device")

# what every policy needs beyond predict (wamkit.policies.base.Policy provides them all); a class that does not
# subclass Policy must have each of them
POLICY_MEMBERS = ("predict", "max_batch_size", "warmup", "close", "remote_codec", "replica")


# ---- `package.module:attr` targets ----------------------------------------------------------------------------------

def is_import_target(s: Any) -> bool:
    """Whether `s` reads as `package.module:attr` (and is not an existing path)."""
    if not isinstance(s, str) or s.count(":") != 1 or Path(s).exists():
        return False
    mod, attr = s.split(":")
    return all(p.isidentifier() for p in mod.split(".")) and all(p.isidentifier() for p in attr.split("."))


def _import_module(mod: str, target: str, what: str, search_cwd: bool = True):
    """importlib.import_module, the current directory also searched (as `python -m` and uvicorn do) unless
    search_cwd is false, every failure one line."""
    try:
        try:
            return importlib.import_module(mod)
        except ModuleNotFoundError as e:
            cwd = os.getcwd()
            missing = e.name or ""
            if not search_cwd or cwd in sys.path or "" in sys.path or \
                    not (mod == missing or mod.startswith(missing + ".")):
                raise
            sys.path.append(cwd)   # last: a module here never shadows an installed one
            importlib.invalidate_caches()
            return importlib.import_module(mod)
    except ModuleNotFoundError as e:
        where = "" if e.name not in (mod, mod.split(".")[0]) else \
            " (is its directory on PYTHONPATH, or the current directory?)"
        raise UserError(f"{what} {target!r}: cannot import module {mod!r}: {e}{where}") from None
    except Exception as e:  # noqa: BLE001 - the module itself raised (a syntax error, a failing import inside it)
        tb = e.__traceback__
        line = ""
        while tb is not None:
            line = f" ({tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"
            tb = tb.tb_next
        msg = str(e).splitlines()[0] if str(e) else ""
        raise UserError(f"{what} {target!r}: importing module {mod!r} failed: {type(e).__name__}: {msg}{line}") \
            from None


def import_target(target: str, what: str = "import target", search_cwd: bool = True):
    """The object `package.module:attr` names (attr may be dotted: `mod:Outer.Inner`); one line (UserError) when
    the module cannot be imported or has no such attribute. search_cwd: a module that is not on sys.path is also
    looked for in the current directory."""
    mod, _, attr = target.partition(":")
    if not mod or not attr:
        raise UserError(f"{what} {target!r}: expected package.module:Name")
    obj = _import_module(mod, target, what, search_cwd)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{what} {target!r}: cannot import {attr!r}: module {mod!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def _spec(name: str, search: list[str] | None):
    """The import spec of `name` (top-level: every finder; a submodule: the path finder over its package's
    `search` locations), or None; nothing is imported."""
    try:
        return importlib.util.find_spec(name) if search is None else \
            importlib.machinery.PathFinder.find_spec(name, search)
    except (ImportError, ValueError):
        return None


def module_places(mod: str) -> list[Path] | None:
    """The files and package directories `mod` and each package above it come from (a module already imported:
    where it was; else where sys.path as it stands would find it), outermost first; nothing is imported or run.
    None when it is not found."""
    places: list[Path] = []
    search = None
    parts = mod.split(".")
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        m = sys.modules.get(name)
        spec = getattr(m, "__spec__", None) or _spec(name, search)
        if spec is None:
            return None
        if spec.origin and spec.has_location:
            places.append(Path(spec.origin))
        search = list(getattr(m, "__path__", None) or spec.submodule_search_locations or [])
        places += [Path(p) for p in search]
    return places


def import_roots(target: str) -> list[str]:
    """The sys.path entries `target`'s top-level package comes from (where it was imported, else where it would be:
    nothing is imported here): what another process needs on its PYTHONPATH to import it too. [] for wamkit's own
    modules or where it cannot be told (not importable here: the other process says why)."""
    top = target.partition(":")[0].split(".")[0]
    if top == "wamkit":
        return []
    m = sys.modules.get(top)
    spec = getattr(m, "__spec__", None) or (_spec(top, None) if m is None else None)
    paths = list(getattr(m, "__path__", None) or getattr(spec, "submodule_search_locations", None) or [])
    if paths:                                   # a package (or namespace package): the directory above it
        roots = {str(Path(p).resolve().parent) for p in paths}
    else:
        f = getattr(m, "__file__", None) or (spec.origin if spec is not None and spec.has_location else None)
        roots = {str(Path(f).resolve().parent)} if f else set()
    # an installed package (this interpreter's prefixes: stdlib, site-packages) is found there anyway; putting such
    # a directory on PYTHONPATH would put it ahead of the standard library
    prefixes = {str(Path(p).resolve()) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    return sorted(r for r in roots if not any(r == p or r.startswith(p + os.sep) for p in prefixes))


# ---- the registry ----------------------------------------------------------------------------------------------------

def register_policy(name: str, target: str, *, override: bool = False) -> None:
    """Make `name` a policy name (for make_policy and every verb in this process) for the class `target`
    ("package.module:Class", imported when first used). Refused (UserError): a malformed target, a name that is not
    a plain word, and replacing a registered name with another class (a built-in one included) unless
    override=True. Other processes (a server `wamkit eval inference=server` starts) do not see this registration:
    evaluation passes them the target itself, and exports record it; on the command line use
    `policy=package.module:Class` directly."""
    if not isinstance(name, str) or not name or ":" in name or "/" in name or name != name.strip():
        raise UserError(f"register_policy: {name!r} is not a valid policy name (a word such as 'my-policy', "
                        f"without ':' or '/')")
    if not is_import_target(target):
        raise UserError(f"register_policy({name!r}, {target!r}): the target must be 'package.module:Class'")
    old = _REGISTRY.get(name)
    if old is not None and old != target and not override:
        kind = "built-in policy" if name in BUILTIN else "policy"
        raise UserError(f"register_policy({name!r}, {target!r}): {name!r} is already the {kind} {old}; choose "
                        f"another name (or pass override=True to replace it)")
    _REGISTRY[name] = target


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def policy_target(name: str) -> str:
    """What to pass to another process for the policy `name`: a name registered (or a built-in name replaced) in
    this process only becomes its `package.module:Class`; anything else is returned as it is."""
    if name in _REGISTRY and _REGISTRY[name] != BUILTIN.get(name):
        return _REGISTRY[name]
    return name


def class_target(cls: type) -> str:
    """`package.module:Class` of `cls` (what an export manifest records for a policy that is not a built-in)."""
    return f"{cls.__module__}:{cls.__qualname__}"


def policy_class(name: str, search_cwd: bool = True):
    """The class of a registered name or of `package.module:Class`, checked (check_policy_class). Anything else is
    one line naming the valid choices. search_cwd: a module not on sys.path is also looked for in the current
    directory (a name typed by the user; not for a manifest's, see manifest_policy_class)."""
    if name in _REGISTRY:
        target = _REGISTRY[name]
    elif is_import_target(name):
        target = name
    else:
        err = unknown_choice("policy", name, policy_names() + ["package.module:Class",
                                                               "<dir written by wamkit export>"])
        d = Path(str(name))
        if d.is_dir() and ((d / "checkpoints").is_dir() or (d / "policy.json").exists()):   # a training run/step
            err = UserError(f"{name} is a training run or checkpoint, not a servable policy: `wamkit export {name} "
                            f"OUT` writes one (then policy=OUT)")
        raise err
    cls = import_target(target, what="policy", search_cwd=search_cwd)
    check_policy_class(cls, name if name == target else f"{name} ({target})")
    return cls


def manifest_policy_class(name: str, manifest: str | Path):
    """policy_class for the policy a manifest file on disk names (an export's wamkit_policy.json, a checkpoint's
    policy.json: files that may come from anyone, e.g. downloaded). A module other than wamkit's own is imported
    only from sys.path as it stands, never the current directory added to it nor from a file inside the manifest's
    directory (which `python -m` from there would put on sys.path): else one line (UserError) saying so; it is named
    in one logged line before it is imported (importing a module runs it)."""
    target = _REGISTRY.get(name, name)
    mod = target.partition(":")[0]
    if is_import_target(target) and mod.split(".")[0] != "wamkit":
        manifest = Path(manifest)
        home = manifest.resolve().parent
        places = module_places(mod)
        how = ("install it, or put the directory that holds it on PYTHONPATH (outside the export) to import it on "
               "purpose")
        if places is None:
            raise UserError(f"policy {target!r} named by {manifest.name}: module {mod!r} is not importable from "
                            f"sys.path (a manifest's module is not looked for in the current directory): {how}")
        inside = next((p for p in places if p.resolve() == home or home in p.resolve().parents), None)
        if inside is not None:
            raise UserError(f"policy {target!r} named by {manifest.name}: module {mod!r} would be imported from "
                            f"{inside}, inside that directory, whose files are never run: {how}")
        log.warning("policy %s named by %s: importing module %s from %s", target, manifest, mod, places[-1])
    return policy_class(name, search_cwd=False)


def check_policy_class(cls: Any, name: str) -> None:
    """One line (UserError) when `cls` cannot be a policy: not a class, not a wamkit Policy (a subclass of
    wamkit.policies.base.Policy, or a class with every member of POLICY_MEMBERS), `predict` left abstract, or a
    `config_class` that is not a dataclass."""
    from wamkit.policies.base import Policy

    if not inspect.isclass(cls):
        raise UserError(f"policy {name!r} is a {type(cls).__name__}, not a class (expected a subclass of "
                        f"wamkit.policies.base.Policy)")
    if issubclass(cls, Policy):
        abstract = sorted(getattr(cls, "__abstractmethods__", ()) or ())
        if abstract:
            raise UserError(f"policy {name!r}: {cls.__name__} does not implement {', '.join(abstract)} (the "
                            f"Policy interface: docs/models.md)")
    else:
        missing = [m for m in POLICY_MEMBERS if not callable(getattr(cls, m, None))]
        if missing:
            raise UserError(f"policy {name!r}: {cls.__name__} is not a wamkit policy (it lacks "
                            f"{', '.join(missing)}): subclass wamkit.policies.base.Policy (docs/models.md, \"Bring "
                            f"your own model\")")
    cfg = getattr(cls, "config_class", None)
    if cfg is not None and not dataclasses.is_dataclass(cfg):
        raise UserError(f"policy {name!r}: {cls.__name__}.config_class is not a dataclass (it lists the policy's "
                        f"options: docs/models.md)")


# ---- building one ----------------------------------------------------------------------------------------------------

def _init_keywords(cls: type) -> tuple[list[str], bool]:
    """(keyword parameters of cls.__init__ but self and config, whether it also takes **kwargs)."""
    try:
        params = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return [], True
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             and p.name not in ("self", "config")]
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def option_keys(cls: type) -> set[str] | None:
    """The keyword options `cls` takes: its config_class's fields plus the other keyword parameters of its
    __init__ (e.g. action_pipeline); None where __init__ takes any keyword (and has no config_class)."""
    from wamkit.core.config import option_names

    named, var_kw = _init_keywords(cls)
    if dataclasses.is_dataclass(getattr(cls, "config_class", None)):
        return option_names(cls) | set(named)
    return None if var_kw else set(named)


def check_policy_args(name: str, cls: type, kwargs: dict, common: tuple[str, ...] = COMMON_KWARGS) -> dict:
    """The options for `cls`, checked: an unknown key (not one of option_keys, nor a common key) is one line
    naming it and the valid ones; with a config_class the values are checked too (wamkit.core.config's rules).
    Returns the kwargs to build with: old key spellings renamed, common keys the class does not take dropped."""
    from wamkit.core.config import check_options, option_names

    valid = option_keys(cls)
    if dataclasses.is_dataclass(getattr(cls, "config_class", None)):
        cfg_keys = option_names(cls)
        extra = {k: v for k, v in kwargs.items() if k in valid and k not in cfg_keys}   # __init__'s own keywords
        rest = check_options("policy_args", name, cls, {k: v for k, v in kwargs.items() if k not in extra},
                             common=common)
        return {**{k: v for k, v in rest.items() if k in valid}, **extra}
    if valid is None:
        return dict(kwargs)
    unknown = sorted(k for k in kwargs if k not in valid and k not in common)
    if unknown:
        raise ConfigError(f"{', '.join(f'policy_args.{k}' for k in unknown)}: not an option of {name!r}; valid "
                          f"keys: {', '.join(sorted(valid))}")
    return {k: v for k, v in kwargs.items() if k in valid}


def construct(cls: type, name: str, kwargs: dict, common: tuple[str, ...] = COMMON_KWARGS):
    """`cls(**options)`, the options checked (check_policy_args), the instance checked (check_built)."""
    policy = cls(**check_policy_args(name, cls, kwargs, common))
    check_built(policy, name)
    return policy


def check_built(policy: Any, name: str) -> None:
    """One line (UserError) when a built policy lacks what every caller reads: `spec`, a PolicySpec with an action
    dim and a horizon >= 1 (the server's metadata, the checks of what predict returns)."""
    from wamkit.policies.base import PolicySpec

    spec = getattr(policy, "spec", None)
    if not isinstance(spec, PolicySpec):
        got = "no `spec`" if spec is None else f"a spec of type {type(spec).__name__}"
        raise UserError(f"policy {name!r}: {type(policy).__name__} has {got}; its __init__ must set self.spec to a "
                        f"wamkit.policies.base.PolicySpec (what it reads and returns: docs/models.md)")
    a = spec.action
    if not (isinstance(a.dim, int) and a.dim >= 1 and isinstance(a.horizon, int) and a.horizon >= 1):
        raise UserError(f"policy {name!r}: spec.action must have dim >= 1 and horizon >= 1, got dim={a.dim!r}, "
                        f"horizon={a.horizon!r}")
