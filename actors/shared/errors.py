"""Errors raised by the KV manager library."""

from __future__ import annotations


class KVError(Exception):
    """A caller broke a contract: double free, unknown block or request, bad token counts.

    Raised before any state is changed, so the manager stays consistent and usable.
    """


class KVInvariantError(AssertionError):
    """``check()`` found the bookkeeping inconsistent (a bug in this library, never the caller's)."""
