"""The script's seeds shifted by an offset (tune's other-seed run), each call taking what plain
python takes: the same arguments accepted, the same errors raised.

A seed is offset where an offset means something -- an int (random, NumPy, torch), random's
str/bytes/float, NumPy's array of ints -- and passed through as given otherwise: None or no
argument (the OS's entropy) and anything the call would refuse, which then raises its own error.
torch.manual_seed seeds CUDA through torch.cuda.manual_seed_all: a call inside another is passed
through, so each generator is shifted once.

    >>> import random
    >>> offset_seeds(1)
    >>> random.seed(5); a = random.random()
"""

from __future__ import annotations

import functools
import operator
import threading

_U64 = 2**64
_U32 = 2**32


def _random_seed(a, offset: int):
    """random.seed's `a`: None, int, float, str, bytes, bytearray (3.11's list)."""
    if isinstance(a, (int, float)):
        return a + offset
    suffix = f"\0perfloop seed offset {offset}"
    if isinstance(a, str):
        return a + suffix
    if isinstance(a, (bytes, bytearray)):
        return type(a)(a + suffix.encode())
    return a


def _torch_seed(seed, offset: int):
    """torch.manual_seed takes what int() reads, within [-2**63, 2**64 - 1]."""
    try:
        s = int(seed)
    except (TypeError, ValueError, RuntimeError):
        return seed
    return (s + offset) % _U64 if -(2**63) <= s < _U64 else seed


def _numpy_seed(seed, offset: int):
    """np.random.seed takes an int in [0, 2**32) or a non-empty 1-d array of them (DataLoader
    workers give it a list of four)."""
    import numpy as np

    if seed is None:
        return seed
    try:
        s = operator.index(seed)
    except TypeError:
        try:
            arr = np.asarray(seed)
        except Exception:
            return seed
        if arr.dtype.kind not in "iu" or arr.ndim != 1 or not arr.size or arr.min() < 0 or arr.max() >= _U32:
            return seed
        arr = arr.astype(np.int64)
        arr[0] = (arr[0] + offset) % _U32
        return arr
    return (s + offset) % _U32 if 0 <= s < _U32 else seed


def _rng_seed(seed, offset: int):
    """np.random.default_rng's int seed (>= 0); a SeedSequence, a generator or None as given."""
    try:
        s = operator.index(seed)
    except TypeError:
        return seed
    return s + offset if s >= 0 else seed


_inside = threading.local()


def _shifted(fn, name: str, shift, offset: int):
    """fn with its seed (the first positional argument, or the keyword `name`) shifted."""

    @functools.wraps(fn)
    def seeded(*args, **kwargs):
        if getattr(_inside, "on", False):
            return fn(*args, **kwargs)
        if args:
            args = (shift(args[0], offset), *args[1:])
        elif name in kwargs:
            kwargs = {**kwargs, name: shift(kwargs[name], offset)}
        _inside.on = True
        try:
            return fn(*args, **kwargs)
        finally:
            _inside.on = False

    return seeded


def offset_seeds(offset: int) -> None:
    """Shift every seed the script sets (torch, CUDA, random, NumPy's legacy and default_rng)
    by `offset`; 0 leaves them as they are."""
    import random

    import torch

    if not offset:
        return
    shifted = _shifted(torch.manual_seed, "seed", _torch_seed, offset)
    torch.manual_seed = torch.random.manual_seed = shifted
    torch.cuda.manual_seed = _shifted(torch.cuda.manual_seed, "seed", _torch_seed, offset)
    torch.cuda.manual_seed_all = _shifted(torch.cuda.manual_seed_all, "seed", _torch_seed, offset)
    random.seed = _shifted(random.seed, "a", _random_seed, offset)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed = _shifted(np.random.seed, "seed", _numpy_seed, offset)
    np.random.default_rng = _shifted(np.random.default_rng, "seed", _rng_seed, offset)
