"""The drafters in transformers' Auto classes, without making `import angelspec_hf` import torch.

Registering a class with `AutoConfig` / `AutoModel` needs the class, and the classes need torch and transformers'
modeling code (seconds to import), while `angelspec --help` should answer at once. transformers has no lazy registry
for third-party model types (its `CONFIG_MAPPING_NAMES` names only its own modules), so `import angelspec_hf` makes
the table of registered model types in `AutoConfig`'s mapping register the drafters just before its first lookup:
right away if transformers' Auto classes are loaded, else as soon as `configuration_auto` has run (a one-shot import
hook). A lookup happens when a checkpoint is loaded (`AutoConfig` / `AutoModel.from_pretrained`, `pipeline`), never
while modules import, so `import angelspec_hf` and `AutoModel.from_pretrained(drafter_folder)` work in either order.
Importing the drafter classes themselves (`angelspec_hf.models`) registers them, with transformers' public `register`
calls; this module only decides when that import happens, so it never imports the classes at its own import. The
same kind of hook lets transformers' file lookups take a shipped card's name (`hub.resolve_shipped_names`) from when
`transformers.utils.hub` loads.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys


CONFIG_AUTO = "transformers.models.auto.configuration_auto"
TRANSFORMERS_HUB = "transformers.utils.hub"
_registered = False


def register_drafters() -> None:
    """Import the drafter classes, which registers them (`angelspec_hf.models` calls transformers' public
    `AutoConfig.register` / `AutoModel.register` when it is imported; idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True  # the lookups made while the classes import do not start it again
    try:
        importlib.import_module(f"{__package__}.models")
    except BaseException:
        _registered = False
        raise


class _RegisterBeforeLookup(dict):
    """`CONFIG_MAPPING._extra_content` (the model types registered beside transformers' own): every read registers
    the drafters first."""

    def _read(self):
        register_drafters()
        return self

    def __contains__(self, key):
        return dict.__contains__(self._read(), key)

    def __getitem__(self, key):
        return dict.__getitem__(self._read(), key)

    def __iter__(self):
        return dict.__iter__(self._read())

    def get(self, key, default=None):
        return dict.get(self._read(), key, default)

    def keys(self):
        return dict.keys(self._read())

    def values(self):
        return dict.values(self._read())

    def items(self):
        return dict.items(self._read())


def _register_before_lookup(configuration_auto) -> None:
    mapping = configuration_auto.CONFIG_MAPPING
    if not isinstance(mapping._extra_content, _RegisterBeforeLookup):
        mapping._extra_content = _RegisterBeforeLookup(mapping._extra_content)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the module `name` it returns the module's own spec, with a loader that, once the
    module has run, removes this hook and calls `then(module)`."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            sys.meta_path[:] = [finder for finder in sys.meta_path if finder is not self]
            self.then(module)

        spec.loader.exec_module = exec_module
        return spec


def _when_imported(name: str, then) -> None:
    """`then(module)` now if the module `name` is loaded, else right after it loads."""
    if name in sys.modules:
        then(sys.modules[name])
    elif not any(isinstance(finder, _AfterImport) and finder.name == name for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))


def _resolve_shipped_names(hub_module) -> None:
    from .hub import resolve_shipped_names  # huggingface_hub is loaded by then: transformers' hub module imports it

    resolve_shipped_names(hub_module)


def register_on_first_lookup() -> None:
    """Arm `AutoConfig`'s mapping now if transformers' Auto classes are loaded, else when they load; and let
    transformers' file lookups find the shipped cards by name (`hub.resolve_shipped_names`) from when they load."""
    _when_imported(CONFIG_AUTO, _register_before_lookup)
    _when_imported(TRANSFORMERS_HUB, _resolve_shipped_names)
