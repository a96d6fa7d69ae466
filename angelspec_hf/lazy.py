"""Names of a package imported on first use (PEP 562), as transformers' own are: `import angelspec_hf` and the
light modules under it (`angelspec --help`, policy labels) import no torch."""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, str]):
    """The `__getattr__` and `__dir__` of `package`, which exports each name of `exports` from the submodule it maps
    to, imported the first time the name is asked for (then kept in the package's namespace)."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{exports[name]}", package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
