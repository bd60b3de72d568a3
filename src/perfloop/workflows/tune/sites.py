"""Where in the user's code the lines to add go: the line that builds its model, the line that
builds its optimizer, the line that first calls its model. Read in one run of the unchanged
script (the first baseline's); what the script does is unchanged (the wrappers call through
first, what they read never raises into it, and they are taken off once every site wanted is
found)."""

from __future__ import annotations

import functools
import linecache
import os
import sys
import sysconfig
from enum import Enum


class Site(str, Enum):
    MODEL = "model"
    OPTIMIZER = "optimizer"
    CALL = "call"

    @property
    def words(self) -> str:
        return {"model": "builds the model", "optimizer": "builds the optimizer", "call": "calls the model"}[
            self.value
        ]


_LIBRARY = ("site-packages", "dist-packages")
_PERFLOOP = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _user_code(filename: str) -> bool:
    """Whether a frame's file is the user's: not an installed package's, Python's own, or
    perfloop's."""
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    parts = set(path.split(os.sep))
    return not (parts & set(_LIBRARY)) and not path.startswith((_STDLIB, _PERFLOOP))


_STDLIB = sysconfig.get_paths()["stdlib"]


class Sites:
    """`wanted`: the sites to find before the hooks come off. A site is the innermost frame of the
    user's own code (the script, or a file of theirs it imports: nanoGPT's model.py builds its
    optimizer) past the object's own constructors; where a library stands there first (a
    Trainer building the optimizer), the site is not the user's line to change, and is not
    said."""

    def __init__(self, wanted: frozenset[Site] = frozenset(Site)):
        self.wanted = wanted
        self.built: dict[int, tuple[str, int]] = {}  # id(module or optimizer) -> (file, line)
        self.found: dict[Site, tuple[str, int]] = {}
        self._user: dict[str, bool] = {}  # a code object's file name -> whether it is the user's
        self._wrapped: list[tuple[type, object]] = []

    def here(self, built=None) -> tuple[str, int] | None:
        """The innermost frame on the stack now past perfloop's own and `built`'s constructors:
        (file, line) where it is the user's code, else None."""
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if code.co_filename.startswith(_PERFLOOP) or (
                built is not None and code.co_name == "__init__" and frame.f_locals.get("self") is built
            ):
                frame = frame.f_back
                continue
            user = self._user.get(code.co_filename)
            if user is None:
                user = self._user[code.co_filename] = _user_code(code.co_filename)
            return (os.path.abspath(code.co_filename), frame.f_lineno) if user else None
        return None

    def hook(self) -> None:
        """Record where each module and optimizer is built (only those built from the script)."""
        import torch

        for cls in (torch.nn.Module, torch.optim.Optimizer):
            init = cls.__init__

            @functools.wraps(init)
            def recorded(obj, *args, __init=init, **kwargs):
                __init(obj, *args, **kwargs)
                try:
                    if id(obj) not in self.built and (at := self.here(obj)) is not None:
                        self.built[id(obj)] = at
                except Exception:  # never the script's problem
                    pass

            self._wrapped.append((cls, init))
            cls.__init__ = recorded

    def unhook(self) -> None:
        for cls, init in self._wrapped:
            cls.__init__ = init
        self._wrapped.clear()

    def saw(self, site: Site, obj=None) -> None:
        """The script's model (its first call: where it is called, and where it was built) or its
        optimizer (its first step: where it was built)."""
        try:
            at = self.here() if site is Site.CALL else self.built.get(id(obj))
            if at is not None:
                self.found.setdefault(site, at)
        except Exception:
            pass
        if site in self.wanted:
            self.wanted = self.wanted - {site}
            if not self.wanted:
                self.unhook()

    def readings(self) -> dict[str, dict]:
        """site -> {"file", "line", "text"} (the line as the script has it)."""
        out = {}
        for site, (f, n) in self.found.items():
            out[site.value] = {"file": f, "line": n, "text": linecache.getline(f, n).strip()}
        return out


def said(site: Site, at: dict) -> str:
    """`train.py:6 builds the optimizer: opt = torch.optim.AdamW(...)`."""
    return f"{os.path.basename(at['file'])}:{at['line']} {site.words}: {at['text']}"
