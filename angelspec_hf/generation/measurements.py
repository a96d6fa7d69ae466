"""Measurements of this machine kept between runs (the verify-cost profile, the linear-kernel plan): keyed by what
they depend on, written atomically, re-measured with a warning when what is cached cannot be read."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import tempfile
from typing import Callable

import torch
from transformers.utils import logging


logger = logging.get_logger(__name__)


def installed_plan(model: torch.nn.Module):
    """The linear-kernel plan `model`'s layers follow (`kernels.tune_linear_kernels` gives each tuned layer its
    `kernel_plan`), or None."""
    return next((module.kernel_plan for module in model.modules() if hasattr(module, "kernel_plan")), None)


def machine_description(target) -> dict:
    """What a latency profile depends on: the target's shape and precision, the device, threads, torch, and the
    linear-kernel plan its layers follow (`installed_plan`; "default": none)."""
    config = target.config.get_text_config()
    plan = installed_plan(target)
    return {
        "target": getattr(config, "_name_or_path", "") or config.model_type,
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "vocab_size": config.vocab_size,
        "dtype": str(target.dtype),
        "device": str(target.device),
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "linear_kernels": plan.fingerprint() if plan is not None else "default",
    }


def cache_root() -> str:
    """The package's cache on this machine: `$ANGELSPEC_CACHE`, default ~/.cache/angelspec_hf."""
    return os.environ.get("ANGELSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "angelspec_hf")


def cache_path(kind: str, target) -> str:
    """Where a measurement of `kind` of `target` on this machine is cached (`cache_root`), keyed by
    `machine_description`."""
    key = hashlib.sha1(json.dumps(machine_description(target), sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_root(), kind, f"{key}.json")


def write_json_atomically(path: str, data) -> None:
    """Write `data` as JSON through a temporary file renamed over `path`: a reader never sees half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(handle, "w") as stream:
        json.dump(data, stream, indent=1)
    os.replace(temporary, path)


@contextlib.contextmanager
def measuring(path: str):
    """Held while this process measures what it caches at `path` (a file lock beside it): a process that wants the
    same measurement meanwhile waits, then reads it, so that processes starting together measure once, and never
    under each other's load. Where the cache folder cannot be written, no lock is taken."""
    from filelock import FileLock

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        lock = FileLock(f"{path}.lock")
        lock.acquire()
    except OSError:
        yield
        return
    try:
        yield
    finally:
        lock.release()


def read_cached(path: str, load: Callable, what: str):
    """`load(path)` of a cached measurement; None when nothing is cached there, or, with a warning, when what is
    there is unreadable or invalid (then it is measured again)."""
    if not os.path.exists(path):
        return None
    try:
        return load(path)
    except (OSError, ValueError, TypeError, KeyError) as error:
        logger.warning(f"{what} {path} is unreadable ({error}); measuring this machine again.")
        return None


def keep_cached(path: str, measurement, what: str) -> None:
    """`measurement.save(path)`; a cache folder that cannot be written is warned about, and the measurement is
    used without saving it."""
    try:
        measurement.save(path)
    except OSError as error:
        logger.warning(f"Could not cache the {what} at {path} ({error}); using it without saving.")


def read_or_measure(path: str, load: Callable, what: str, measure: Callable, usable: Callable = None, fresh=False):
    """The measurement cached at `path` (`read_cached`) when `usable(it)`, else `measure(what is cached, or None)`,
    kept there (`keep_cached`). The measuring happens under `measuring(path)`, after reading the cache again: another
    process may have measured while this one waited. `fresh` measures whatever is cached."""

    def cached():
        found = None if fresh else read_cached(path, load, what[:1].upper() + what[1:])
        return found, found is not None and (usable is None or usable(found))

    found, ok = cached()
    if ok:
        return found
    with measuring(path):
        found, ok = cached()
        if ok:
            return found
        measurement = measure(found)
        keep_cached(path, measurement, what)
    return measurement
