"""The user-error hierarchy every layer raises and the CLI catches once.

A ``UserError`` is a problem the user fixes in their config, data or environment: the CLI prints its message
as one line, with no traceback, and exits 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Base of every error whose message names the bad input and the fix."""


class SetupError(UserError, RuntimeError):
    """A problem the user fixes in their config or environment (printed as one line, no traceback)."""
