"""What the commands share: `UsageError`, and the checks of what a command line names on disk — models, prompt
files, output paths — that each command's `check` makes before any model loads."""

from __future__ import annotations

import argparse
import os
import re

from ..prompts import check_prompt_source, check_single_turn


class UsageError(ValueError):
    """A mistake in the command line or in the files it names: reported in one line, exit status 2."""


HUB_ID = re.compile(r"[\w-][\w.-]*(/[\w-][\w.-]*)?")


def check_target_arguments(args: argparse.Namespace) -> None:
    """`add_target_arguments`' `--target`, and its `--device` (that PyTorch can place a tensor there)."""
    check_target(args.target)
    if args.device != "cpu":
        import torch

        try:
            torch.empty(0, device=args.device)
        except (RuntimeError, AssertionError) as error:
            raise UsageError(f"--device {args.device}: {str(error).splitlines()[0]}") from None


def check_target(target: str) -> None:
    """`--target`: the embedded `smollm2`, a model folder (`FOLDER::FILE` a GGUF file in it) or a Hub id."""
    if target != "smollm2":
        folder, _, gguf_file = target.partition("::")
        check_model("--target", folder, "target", filename=gguf_file or "config.json")
        if gguf_file and os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, gguf_file)):
            raise UsageError(f"--target {target}: no file {gguf_file} in {folder}")


def check_drafter(drafter: str | None) -> None:
    """`--drafter`, where one is named: a folder, a shipped drafter's name or a Hub id."""
    if drafter:
        check_model("--drafter", drafter, "drafter")


def check_context(args: argparse.Namespace) -> None:
    """`--max-new-tokens` leaves room for a prompt in `--target`'s context."""
    from ..targets import target_context_length

    context = target_context_length(args.target)
    if context is not None and args.max_new_tokens >= context:
        raise UsageError(
            f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the target's context of "
            f"{context} positions"
        )


def check_data_dir(data_dir: str | None) -> None:
    if data_dir is not None and not os.path.isdir(data_dir):
        raise UsageError(f"--data-dir {data_dir}: no such folder")


def check_prompt_sources(sources: list[str], data_dir: str | None, single_turn: bool = False) -> None:
    """Each prompt set name, mixture or file can be read (`prompts.check_prompt_source`); with `single_turn`, none
    is a set of dialogues (for a command that reads first turns alone)."""
    for source in sources:
        try:
            check_prompt_source(source, data_dir)
            if single_turn:
                check_single_turn(source)
        except (OSError, ValueError) as error:
            raise UsageError(str(error)) from None


def check_model(flag: str, path: str, kind: str, hub: bool = True, filename: str = "config.json") -> None:
    """`path` is a model folder, a shipped drafter's name, or, where `hub`, a Hub id (offline: one whose `filename`
    is in the local cache)."""
    if os.path.isdir(path):
        return
    if kind == "drafter":
        from ..hub import resolve_drafter

        if os.path.isdir(resolve_drafter(path)):
            return
    # a drafter's Hub id names its owner (`load_drafter`): a bare name that is no shipped card is refused, online too
    hub_id = hub and HUB_ID.fullmatch(path) is not None and (kind != "drafter" or "/" in path)
    if hub_id and _on_hub(path, filename):
        return
    hint = " (and it is not a Hub id available offline)" if hub_id else ""
    raise UsageError(f"{flag} {path}: no {kind} folder of that name{hint}")


def _on_hub(repo_id: str, filename: str) -> bool:
    """Whether `from_pretrained(repo_id)` can find it: always assumed online, from the local cache offline."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() not in ("1", "ON", "YES", "TRUE"):
        return True
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, filename), str)
    except ValueError:  # not a valid repo id after all (e.g. "a..b")
        return False


def check_writable(flag: str, path: str | None, folder: bool = False) -> None:
    """`path`, where given (a file, or a `folder`), can be written, missing parent folders created, without writing
    anything yet."""
    if not path:
        return
    full = os.path.abspath(path)
    if os.path.isdir(full) != folder and os.path.exists(full):
        raise UsageError(f"{flag} {path}: " + ("not a folder" if folder else "is a folder"))
    existing = full
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) and existing != full:
        raise UsageError(f"{flag} {path}: cannot be created, {existing} is a file")
    if not os.access(existing, os.W_OK):
        raise UsageError(f"{flag} {path}: cannot be written, {existing} is read-only")
