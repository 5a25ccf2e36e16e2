"""Who may send, which runs, and who may read ``/metrics``.

A token file has one token per line, optionally followed by the run ids it
may write, as shell globs (``fnmatch``); each line is one owner, holding at most
``--max-runs-per-token`` runs at a time::

    # token              runs
    3f9a...c1            llama-8b-*
    77be...04            eval-*  ablation-?
    a0c4...9e                                  # no globs: any run

Blank lines and ``#`` comments are skipped. A request whose bearer token is in
no line is ``401``; a request carrying a step span of a run its token does
not cover is ``403`` as a whole (``reason="forbidden"``), so one job's token
cannot write another job's run. Tokens are compared in constant time.
"""

from __future__ import annotations

import fnmatch
import hmac
import os
from dataclasses import dataclass

__all__ = ["ANY_RUN", "Grant", "Tokens", "authorized_grant", "read_token_file"]


@dataclass(frozen=True)
class Grant:
    """What a token allows: ``runs`` globs, or None for any run.

    ``owner`` names the token-file line it came from ("" for the one shared token or
    no authentication): the collector admits at most ``--max-runs-per-token`` runs per
    owner, so one job's token cannot take every run slot.
    """

    runs: tuple[str, ...] | None
    owner: str = ""

    def allows(self, run_id: str) -> bool:
        return self.runs is None or any(fnmatch.fnmatchcase(run_id, glob) for glob in self.runs)


ANY_RUN = Grant(None)


class Tokens:
    """The accepted tokens and what each may write."""

    def __init__(self, entries: list[tuple[str, Grant]]):
        self._entries = [(token.encode(), grant) for token, grant in entries]

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def check(self, header: str | None) -> Grant | None:
        """The grant of the ``Authorization: Bearer`` header's token, or None (refuse)."""
        if not header:
            return None
        scheme, _, credentials = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        presented = credentials.strip().encode()
        found = None
        for token, grant in self._entries:  # no early exit: the time does not say which line matched
            if hmac.compare_digest(presented, token) and found is None:
                found = grant
        return found


def read_token_file(path: str, field: str = "token_file") -> list[tuple[str, Grant]]:
    """Parse a token file; a missing, unreadable or empty file raises ``ValueError`` naming ``field``."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"{field}: cannot read {path!r}: {exc.strerror or exc}") from None
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        token, globs = words[0], tuple(words[1:])
        if len(token) < 8:
            raise ValueError(f"{field}: {path}:{number}: a token must be at least 8 characters")
        entries.append((token, Grant(globs or None, owner=f"{os.path.basename(path)}:{number}")))
    if not entries:
        raise ValueError(f"{field}: {path!r} holds no token")
    return entries


def authorized_grant(tokens: Tokens | None, header: str | None) -> Grant | None:
    """ANY_RUN when no tokens are configured, else the token's grant (None: refuse)."""
    if not tokens:
        return ANY_RUN
    return tokens.check(header)
