"""Where in the user's script the lines to add go: the line that builds its model, the line that
builds its optimizer, the line that first calls its model. Read in one run of the unchanged
script (the first baseline's), from the innermost frame of the script's own file at each of
those moments; what the script does is unchanged (the wrappers call through first, and what
they read never raises into it)."""

from __future__ import annotations

import functools
import linecache
import os
import sys

MODEL, OPTIMIZER, CALL = "model", "optimizer", "call"
_WORDS = {MODEL: "builds the model", OPTIMIZER: "builds the optimizer", CALL: "calls the model"}


class Sites:
    def __init__(self, script: str):
        self.script = os.path.abspath(script)
        self.built: dict[int, tuple[str, int]] = {}  # id(module or optimizer) -> (file, line)
        self.found: dict[str, tuple[str, int]] = {}

    def here(self) -> tuple[str, int] | None:
        """The innermost frame of the script's file on the stack now."""
        frame = sys._getframe(1)
        while frame is not None:
            if os.path.abspath(frame.f_code.co_filename) == self.script:
                return self.script, frame.f_lineno
            frame = frame.f_back
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
                    if id(obj) not in self.built and (at := self.here()) is not None:
                        self.built[id(obj)] = at
                except Exception:  # never the script's problem
                    pass

            cls.__init__ = recorded

    def saw(self, kind: str, obj=None) -> None:
        """The script's model (its first call: where it is called, and where it was built) or its
        optimizer (its first step: where it was built)."""
        try:
            at = self.built.get(id(obj)) if kind in (MODEL, OPTIMIZER) else self.here()
            if at is not None:
                self.found.setdefault(kind, at)
        except Exception:
            pass

    def readings(self) -> dict[str, dict]:
        """kind -> {"file", "line", "text"} (the line as the script has it)."""
        out = {}
        for kind, (f, n) in self.found.items():
            out[kind] = {"file": f, "line": n, "text": linecache.getline(f, n).strip()}
        return out


def said(kind: str, site: dict) -> str:
    """`train.py:6 builds the optimizer: opt = torch.optim.AdamW(...)`."""
    return f"{os.path.basename(site['file'])}:{site['line']} {_WORDS[kind]}: {site['text']}"
