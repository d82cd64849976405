"""Domain errors for every stage: what failed, with the offending values, and how to fix it."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

# The user-info part of a URL (`https://user:password@host`): the password ends at the last
# '@' before the path or query, so one with an '@' in it is masked whole.
_CREDENTIALS = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)([^\s/@:]*):[^\s/?#]*@")


def mask_credentials(text: str) -> str:
    """`text` with the password of every URL in it masked: `http://user:***@host`."""
    return _CREDENTIALS.sub(r"\1\2:***@", text)


class CoralError(Exception):
    """Base class of every error Coral reports to a user (never a bare traceback)."""


class InputError(CoralError):
    """Bad user input or data file: names the field, the bad value and the fix.

    Args:
        field: dotted path of the offending field (``"offers[3].price_usd_per_hour"``).
        problem: what is wrong, with the offending value.
        fix: what the user should do instead.
        suggestions: close known values, shown as "Did you mean ...?".
    """

    def __init__(
        self, field: str, problem: str, fix: str = "", suggestions: Iterable[str] = ()
    ) -> None:
        # A URL may carry a password (a Prometheus URL, from an option or the environment):
        # no message shows it.
        self.field = mask_credentials(field)
        self.problem = mask_credentials(problem)
        self.fix = mask_credentials(fix)
        self.suggestions = list(suggestions)
        super().__init__(self.render())

    def render(self) -> str:
        text = f"{self.field}: {self.problem}"
        if self.fix:
            text += f"\n  To fix: {self.fix}"
        if self.suggestions:
            quoted = ", ".join(f"'{s}'" for s in self.suggestions)
            text += f"\n  Did you mean {quoted}?"
        return text


def unknown_value(field: str, value: str, known: Iterable[str], kind: str) -> InputError:
    """An InputError for an unknown id, suggesting the closest known ones."""
    known_list = sorted(known)
    close = difflib.get_close_matches(value, known_list, n=3, cutoff=0.5)
    if not close:
        # Prefix matches catch ids like "llama2" -> "llama2-70b" that difflib scores low.
        close = [k for k in known_list if k.startswith(value) or value.startswith(k)][:3]
    return InputError(
        field,
        f"unknown {kind} '{value}'",
        f"use one of: {', '.join(known_list)}",
        close,
    )


class StaleLibraryError(InputError):
    """A template library whose inputs changed since it was built (the changed ones named).

    Raised by `load_library`; callers that may rebuild catch it by type.
    """


class AllocationError(CoralError):
    """The allocation ILP gave no plan: the backend is missing, or a solve ended without one.

    Args:
        problem: what failed, with the solver's status and limits.
        status: the solver's status in words (``"infeasible"``, ``"not solved"``), or
            ``"unavailable"`` when the backend could not be created.
        fix: what the user should change.
    """

    def __init__(self, problem: str, status: str, fix: str) -> None:
        self.problem = problem
        self.status = status
        self.fix = fix
        super().__init__(f"allocation: {problem}\n  To fix: {fix}")
