"""Typed configs: dataclasses with defaults next to the code, filled from YAML and `key=value` overrides.

    cfg = load_config(EvalConfig, yaml_path, ["suite=libero_object", "tasks=0,1", "policy_args.size=tiny"])

Rules
- Keys are dataclass field names; nested dataclasses and dict fields take dotted keys (`server.port=8001`).
- Values are coerced to the field's annotated type: int, float, bool, str, list[int]/list[str] (comma separated),
  Optional[...] ("none"/"null" -> None), nested dataclass, dict (free-form; values parsed as YAML scalars, and
  `a,b` without spaces as a list).
- An unknown key raises ConfigError naming the valid keys. Nothing is half-applied: a new object is returned.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
import warnings
from pathlib import Path
from typing import Any, TypeVar

import yaml

from wamkit.core.errors import ConfigError

T = TypeVar("T")


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """['a=1', 'b.c=x'] -> {'a': '1', 'b.c': 'x'} (strings; coercion happens against the dataclass)."""
    out: dict[str, Any] = {}
    for a in args:
        if a.startswith("-") and a not in ("-", "--"):
            raise ConfigError(dash_hint(a))
        if "=" not in a:
            raise ConfigError(f"expected key=value, got {a!r}")
        k, v = a.split("=", 1)
        k = k.strip()
        if not k:
            raise ConfigError(f"empty key in {a!r}")
        out[k] = v
    return out


def dash_hint(arg: str) -> str:
    """One line for `--env=libero` / `--env libero` style input: wamkit keys take no dashes."""
    key, eq, value = arg.lstrip("-").partition("=")
    example = f"{key}={value}" if eq and value else f"{key}=VALUE"
    if key in ("h", "help"):
        return f"unknown option {arg!r}; for help put --help right after the verb (wamkit VERB --help)"
    return f"unknown option {arg!r}; keys are written key=value without dashes, e.g. {example} (see --help)"


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for k, v in flat.items():
        parts = k.split(".")
        d = nested
        for p in parts[:-1]:
            d = d.setdefault(p, {})
            if not isinstance(d, dict):
                raise ConfigError(f"key {k!r} sets a field inside a non-mapping value")
        d[parts[-1]] = v
    return nested


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _yaml_scalar(v: Any) -> Any:
    """A CLI string as YAML would read it; 'a,b,c' (commas, no spaces) becomes a list of scalars."""
    if isinstance(v, str) and "," in v and not any(c.isspace() for c in v) and not v.startswith(("[", "{")):
        return [_yaml_scalar(x) for x in v.split(",") if x != ""]
    if isinstance(v, str):
        try:
            return yaml.safe_load(v)
        except yaml.YAMLError:
            return v
    return v


def _yaml_where(e: yaml.YAMLError) -> str:
    """Where the parser stopped and what it expected there, with what it was parsing, on one line."""
    mark = getattr(e, "problem_mark", None)
    if not isinstance(e, yaml.MarkedYAMLError) or mark is None:
        return f": {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    ctx = e.context_mark
    within = f" ({e.context} at line {ctx.line + 1}, column {ctx.column + 1})" if e.context and ctx is not None else ""
    return f" at line {mark.line + 1}, column {mark.column + 1}: {e.problem}{within}"


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return _yaml_scalar(value)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: cannot parse {value!r}")
    if typing.get_origin(tp) is typing.Literal:
        if value not in args:
            sval = str(value)
            for a in args:
                if str(a) == sval:
                    return a
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, args))}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return _build(tp, value, prefix=key + ".")
    if origin in (list, tuple) or tp in (list, tuple):
        inner = args[0] if args else Any
        if isinstance(value, str):
            items = [s for s in value.split(",") if s.strip() != ""]
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            items = [value]
        vals = [_coerce(inner, it, key) for it in items]
        return tuple(vals) if (origin is tuple or tp is tuple) else vals
    if origin is dict or tp is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return {k: _yaml_scalar(v) for k, v in value.items()}
    if tp is bool:
        return parse_bool(value, key)
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            return int(str(value).strip())
        except ValueError:
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if tp is float:
        try:
            return float(str(value).strip())
        except ValueError:
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    return value


_warned_renames: set[tuple[str, str]] = set()


def renamed_keys(cls: type, data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`data` with a config class's old key spellings (its `RENAMED = {"old": "new"}`) under their new names; each old
    spelling warns once per process. Both spellings at once is a ConfigError."""
    renamed = getattr(cls, "RENAMED", None) or {}
    if not any(k in data for k in renamed):
        return data
    out = dict(data)
    for old, new in renamed.items():
        if old not in out:
            continue
        if new in out:
            raise ConfigError(f"{prefix + old} and {prefix + new} both given: {old!r} is the old name of {new!r}")
        out[new] = out.pop(old)
        if (cls.__qualname__, old) not in _warned_renames:
            _warned_renames.add((cls.__qualname__, old))
            # FutureWarning: shown to users by default (a DeprecationWarning is not, outside __main__)
            warnings.warn(f"config key {prefix + old!r} is now {prefix + new!r} (the old name still works, for now)",
                          FutureWarning, stacklevel=3)
    return out


def _build(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    data = renamed_keys(cls, data, prefix)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        valid = ", ".join(sorted(fields))
        raise ConfigError(f"unknown config key {prefix + unknown[0]!r}; valid keys: {valid}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _coerce(hints[name], data[name], prefix + name)
        elif dataclasses.is_dataclass(hints.get(name)) and f.default is dataclasses.MISSING and \
                f.default_factory is dataclasses.MISSING:
            kwargs[name] = _build(hints[name], {}, prefix + name + ".")
    obj = cls(**kwargs)
    post = getattr(obj, "validate", None)
    if callable(post):
        post()
    return obj


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | dict | None = None,
                base: T | None = None) -> T:
    """Build `cls` from (base or defaults) <- YAML file <- overrides. Raises ConfigError on any bad key/value."""
    data: dict[str, Any] = to_dict(base) if base is not None else {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:   # one line (PyYAML's own message quotes the file's line and a caret)
            raise ConfigError(f"{p}: invalid YAML{_yaml_where(e)}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
        data = _merge(data, loaded)
    if overrides:
        flat = parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides)
        data = _merge(data, _nest(flat))
    return _build(cls, data)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-able dict of a config dataclass (for summaries and checkpoints)."""
    d = dataclasses.asdict(cfg)

    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, Path):
            return str(x)
        return x

    return clean(d)


def split_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """Command-line words `[config.yaml] key=value ...` -> (yaml path or None, overrides)."""
    path = None
    rest = []
    for a in argv:
        if "=" not in a and (a.endswith(".yaml") or a.endswith(".yml")) and path is None:
            path = a
        else:
            rest.append(a)
    return path, rest


def parse_bool(value: Any, key: str = "value") -> bool:
    """true/false, 1/0, yes/no, on/off (any case) or a bool -> bool; anything else is a ConfigError naming `key`."""
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}: expected true/false, got {value!r}")


def is_number(v: Any) -> bool:
    """A finite int or float, not a bool: the one test of "a number" for configs, metadata files and summaries."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return isinstance(v, int) or math.isfinite(v)   # (an int too large for a float is still a number)


def check_number(key: str, value: Any, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                 none_ok: bool = False) -> None:
    """ConfigError naming `key` unless `value` is a finite number within [lo, hi] ((lo, hi] with lo_open); None is
    accepted when none_ok. The one range check of the config dataclasses' validate()."""
    if value is None and none_ok:
        return
    if not is_number(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ConfigError(f"{key} must be {'>' if lo_open else '>='} {lo:g}, got {value!r}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key} must be <= {hi:g}, got {value!r}")
# ---- help generated from the config dataclasses -------------------------------------------------------------------

def field_docs(cls: type) -> dict[str, str]:
    """{field name: one-line meaning} of a config dataclass: `field(metadata={"help": ...})` if given, else the
    trailing `# comment` of the field's line (plus comment-only lines indented under it, which continue it); a field
    inherited from a base dataclass keeps the base's comment unless the subclass comments it again."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is not object and dataclasses.is_dataclass(klass):
            docs.update(_own_field_comments(klass))
    for f in dataclasses.fields(cls):
        if f.metadata.get("help"):
            docs[f.name] = str(f.metadata["help"])
    return docs


def _own_field_comments(cls: type) -> dict[str, str]:
    """The field comments written in `cls`'s own class body."""
    import inspect
    import io
    import re
    import tokenize

    docs: dict[str, str] = {}
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        src = ""
    lines = src.splitlines()
    comments: dict[int, tuple[int, str]] = {}    # line index -> (column, text)
    try:
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0] - 1] = (tok.start[1], tok.string.lstrip("#").strip())
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    body_indent = None
    current = None
    for i, line in enumerate(lines):
        m = re.match(r"^(\s+)(\w+)\s*:", line)
        if m and (body_indent is None or len(m.group(1)) == body_indent) and not line.lstrip().startswith("#"):
            body_indent = len(m.group(1))
            current = m.group(2)
            if i in comments:
                docs[current] = comments[i][1]
            continue
        stripped = line.strip()
        if current and stripped.startswith("#") and i in comments and comments[i][0] > (body_indent or 0):
            docs[current] = (docs.get(current, "") + " " + comments[i][1]).strip()   # a continued comment
        elif stripped:
            current = None
    return docs


def _fmt_default(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return ",".join(_fmt_default(x) for x in v) if v else "[]"
    if isinstance(v, dict):
        return "{}" if not v else ",".join(f"{k}:{_fmt_default(x)}" for k, x in v.items())
    if isinstance(v, str):
        return v if v else '""'
    return str(v)


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [_type_name(a) for a in args if a is not type(None)]
        return " | ".join(inner) + (" | none" if type(None) in args else "")
    if origin is typing.Literal:
        return "|".join(map(str, args))
    if origin in (list, tuple):
        return f"{getattr(origin, '__name__', 'list')}[{', '.join(_type_name(a) for a in args if a is not ...)}]"
    if tp is dict or origin is dict:
        return "mapping (dotted keys)"
    if tp is bool:
        return "true|false"
    return getattr(tp, "__name__", str(tp))


def config_keys(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type or choices, default, meaning) for every key of a config dataclass; nested dataclasses expand into
    dotted keys."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows: list[tuple[str, str, str, str]] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints.get(f.name, Any)
        if dataclasses.is_dataclass(tp):
            rows += config_keys(tp, prefix + f.name + ".")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        rows.append((prefix + f.name, _type_name(tp), "(required)" if default is dataclasses.MISSING
                     else _fmt_default(default), docs.get(f.name, "")))
    return rows


def config_help(cls: type, usage: str, intro: str = "", footer: str = "") -> str:
    """`wamkit VERB --help`: usage, intro, then one line per key: key=default, type or valid choices, meaning."""
    rows = config_keys(cls)
    left = [f"{k}={d}" for k, _, d, _ in rows]
    col = min(max(len(s) for s in left) + 2, 34) if rows else 0   # longer ones get a line of their own
    out = [usage]
    if intro:
        out += ["", intro.strip()]
    out += ["", "keys (key=default  [type or choices]  meaning):"]
    for (k, tp, d, doc), head in zip(rows, left):
        text = f"[{tp}] {doc}".rstrip()
        if len(head) + 2 > col:
            out.append(f"  {head}")
            out.append(" " * (col + 2) + text)
        else:
            out.append(f"  {head:<{col}}{text}")
    out += ["", "Keys go as key=value (no dashes), nested ones dotted (server.port=8001), lists comma-separated (a,b);",
            "an optional YAML file (config.yaml) gives the same keys, overrides win."]
    if footer:
        out += ["", footer.strip()]
    return "\n".join(out)


# ---- constructor options of registered classes (policies, envs) ---------------------------------------------------

def option_names(cls: type) -> set[str]:
    """The keyword options a registered class (policy, env) takes: the fields of its `config_class` dataclass (or of
    `cls` itself when it is that dataclass). A class without one is a programming error (TypeError): every
    registered class declares its options."""
    cfg = cls if dataclasses.is_dataclass(cls) else getattr(cls, "config_class", None)
    if cfg is None or not dataclasses.is_dataclass(cfg):
        raise TypeError(f"{cls.__module__}.{cls.__qualname__} has no config_class (a dataclass of its options)")
    return {f.name for f in dataclasses.fields(cfg) if f.init}


def _refuse_unknown(kind: str, name: str, valid: set[str], keys) -> None:
    unknown = sorted(k for k in keys if k not in valid)
    if unknown:
        shown = ", ".join(f"{kind}.{k}" if kind else k for k in unknown)
        raise ConfigError(f"{shown}: not an option of {name!r}; valid keys: {', '.join(sorted(valid))}")


def check_options(kind: str, name: str, cls: type, kwargs: dict, common: tuple[str, ...] = ()) -> dict:
    """ConfigError naming the misspelled key(s) and every valid one, e.g. `policy_args.sise` for wam-ref. `common`:
    keys callers pass to every class of this kind (each class ignores those it does not use). For a registered class
    (not a bare config dataclass) the values are checked too: its config is built from them and dropped, so a bad
    value is one line before any worker or server starts. Returns the kwargs with old key spellings under their new
    names (the config class's RENAMED), for the caller to build with."""
    valid = option_names(cls)
    cfg_cls = cls if dataclasses.is_dataclass(cls) else cls.config_class
    kwargs = renamed_keys(cfg_cls, kwargs, f"{kind}." if kind else "")
    _refuse_unknown(kind, name, valid, [k for k in kwargs if k not in common])
    if not dataclasses.is_dataclass(cls):
        build_options(cls.config_class, {k: v for k, v in kwargs.items() if k in valid}, kind=kind, name=name)
    return kwargs


def build_options(cfg_cls: type[T], kwargs: dict[str, Any], base: T | None = None, *, kind: str = "",
                  name: str = "") -> T:
    """The options of a registered class: `base` (or the defaults) with `kwargs` on top, checked by the rules at the
    top of this module (unknown key -> ConfigError naming it and the valid keys; values coerced to the field types,
    CLI strings included; the config's `validate()` checks ranges). `kind`/`name` only word the errors
    (`policy_args.horizn: not an option of 'zero'`)."""
    fields = [f for f in dataclasses.fields(cfg_cls) if f.init]
    kwargs = renamed_keys(cfg_cls, kwargs, f"{kind}." if kind else "")
    _refuse_unknown(kind, name or cfg_cls.__name__, {f.name for f in fields}, kwargs)
    data = {f.name: getattr(base, f.name) for f in fields} if base is not None else {}
    data.update(kwargs)
    try:
        return _build(cfg_cls, data, prefix=f"{kind}." if kind else "")
    except ConfigError as e:      # validate()'s messages start with the bare field name: give it its prefix
        msg = str(e)
        if kind and msg.split(" ", 1)[0].rstrip(":") in {f.name for f in fields}:
            raise ConfigError(f"{kind}.{msg}") from None
        raise
