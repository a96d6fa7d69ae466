"""Configuration of the router drafter: several member drafters behind one `assistant_model`."""

from __future__ import annotations

import re

from ..base import AngelSpecDrafterConfig, check_int


MEMBER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_member_names(names: list) -> None:
    """Each member lives in `members/<name>/` of the router's folder: a name must be a plain folder name (letters,
    digits, '.', '_', '-'; no separator, no '..', not absolute), so loading or saving never leaves that folder."""
    for name in names:
        if not isinstance(name, str) or not MEMBER_NAME.fullmatch(name):
            raise ValueError(
                f"Router member name {name!r} is not a plain folder name under members/ "
                "(letters, digits, '.', '_' and '-', starting with a letter or digit)"
            )


class RouterDrafterConfig(AngelSpecDrafterConfig):
    r"""
    Member drafters (MTP, DFly, suffix, ...) of one target, of which each round drafts with the one that promises the
    most tokens per second for each request (AngelSpec's workload co-specialisation, chosen by measured cost).

    Args:
        members (`list[dict]`): each member's config (`config.to_dict()`, `model_type` included); the members'
            weights are the router's, under `members.<i>.`.
        member_names (`list[str]`, *optional*): a name per member (default: each member's family, e.g. `mtp`).
        member_paths (`list[str]`, *optional*): where each member's checkpoint is: `members/<name>` inside the
            router's folder (the default), another folder relative to the router's, or a Hub id; a router that names
            drafters published on their own does not hold a second copy of their weights.
        num_draft_tokens (`int`, *optional*): most tokens per round (default: the most any member drafts by default).
        explore_tokens (`int`, defaults to 64): a request re-tries a member that has not drafted it for this many
            verified tokens, so its estimate of every member stays current.
        free_match_first (`int`, defaults to 2): a member that reads for free (suffix) drafts every round where
            its match is at least this long, before the scores or a due try are weighed (a power of two: matches
            are bucketed by powers of two); 0 weighs every round by the scores.
    """

    model_type = "angelspec_router"
    drafter_kind = "router"

    def __init__(
        self,
        members: list[dict] | None = None,
        member_names: list[str] | None = None,
        member_paths: list[str] | None = None,
        num_draft_tokens: int | None = None,
        explore_tokens: int = 64,
        free_match_first: int = 2,
        **kwargs,
    ):
        super().__init__(**kwargs)
        members = list(members or [])
        if not all(isinstance(member, dict) and isinstance(member.get("model_type"), str) for member in members):
            raise ValueError("members must be the members' configs as dicts, each with its model_type")
        if any(member["model_type"] == self.model_type for member in members):
            raise ValueError("A router cannot be a member of a router")
        if member_names is not None and (
            len(member_names) != len(members) or len(set(member_names)) != len(member_names)
        ):
            raise ValueError(f"member_names must name each of the {len(members)} members once, got {member_names!r}")
        check_member_names(member_names or [])
        if member_paths is not None and (
            len(member_paths) != len(members) or not all(isinstance(path, str) and path for path in member_paths)
        ):
            raise ValueError(
                f"member_paths must give a path for each of the {len(members)} members, got {member_paths!r}"
            )
        if num_draft_tokens is not None:
            check_int("num_draft_tokens", num_draft_tokens)
        check_int("explore_tokens", explore_tokens)
        check_int("free_match_first", free_match_first, minimum=0)
        if free_match_first & (free_match_first - 1):
            raise ValueError(f"free_match_first must be 0 or a power of two, got {free_match_first}")
        self.members = members
        self.member_names = list(member_names) if member_names is not None else None
        self.member_paths = list(member_paths) if member_paths is not None else None
        self.num_draft_tokens = num_draft_tokens
        self.explore_tokens = explore_tokens
        self.free_match_first = free_match_first
