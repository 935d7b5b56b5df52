"""Import-time stand-ins for four modules SGLang's package imports at its top level but the action entrypoint never
calls: GPU kernel libraries (triton, tvm_ffi: no CPU build), torchvision (no build loads beside the project's CPU torch
2.13) and IPython (a notebook helper). Anything that *uses* them fails loudly; the request path of
`sglang/multimodal_gen/runtime/entrypoints/action/` does not."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = ("triton", "tvm_ffi", "torchvision", "IPython")


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any

    def __getitem__(cls, k):
        return _Any


class _Any(metaclass=_Meta):
    """Subclassable, callable (a decorator returns what it decorates), attribute-permissive placeholder."""

    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return a[0] if len(a) == 1 and not k and callable(a[0]) else _Any()

    def __getattr__(self, n):
        if n.startswith("__"):
            raise AttributeError(n)
        return _Any

    def __getitem__(self, k):
        return _Any


class _Module(types.ModuleType):
    def __getattr__(self, n):
        if n.startswith("__"):
            raise AttributeError(n)
        return _Any


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        m = _Module(spec.name)
        m.__path__, m.__spec__, m.__version__ = [], spec, "0.0.0"
        return m

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, _Loader(), is_package=True)
        return None


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
