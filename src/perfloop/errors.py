"""The errors perfloop's layers raise to the ones above them, typed so that a caller (the CLI,
the pytest plugin) tells them apart by class and field, never by their text."""

from __future__ import annotations


class ArgumentError(ValueError):
    """A bad argument, named: `argument` is the parameter (as the caller's code names it), `detail`
    what was wrong and how to fix it. Reads "argument: detail", and is a ValueError.

    >>> str(ArgumentError("shape", "sizes must be positive integers"))
    'shape: sizes must be positive integers'
    """

    def __init__(self, argument: str, detail: str) -> None:
        super().__init__(f"{argument}: {detail}")
        self.argument, self.detail = argument, detail
