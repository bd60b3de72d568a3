"""A generation step read per token: tokens/s and ms a token, the bytes a token moves (counted
over the step's ops) beside what it must read (the weights and the KV cache), and their rate
against the measured copy ceiling -- the figure that bounds a decode step, which reads every
weight once to make one token per sequence.

>>> t = Tokens(per_step=1, step_ms=2.0, bytes_per_step=6e9 * 2e-3, weights_bytes=11e6, cache_bytes=1e6,
...            ceiling_gbps=8.0, source=TokensFrom.GIVEN)
>>> round(t.tokens_per_s), round(t.gbps, 1), round(t.share, 2), round(t.floor_ms, 2)
(500, 6.0, 0.75, 1.5)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from perfloop.harness.measurement import matmul_ceiling


class TokensFrom(str, Enum):
    """Where the tokens a step takes in were read from (`said`: as the reading says it)."""

    GIVEN = "given"
    EMBEDDING = "embedding input"
    CACHE_BATCH = "cache batch"

    @property
    def said(self) -> str:
        return {
            TokensFrom.GIVEN: "--tokens",
            TokensFrom.EMBEDDING: "the embedding's input",
            TokensFrom.CACHE_BATCH: "the KV cache's batch: one token a sequence; --tokens N to say otherwise",
        }[self]


@dataclass(frozen=True)
class Tokens:
    per_step: int  # tokens one step makes (a decode step: one a sequence) or takes in (a prefill)
    step_ms: float  # the step's wall time
    bytes_per_step: float | None  # counted over the step's ops: each op's reads and writes
    weights_bytes: int | None  # the model's parameters a step reads (not embedding tables: rows)
    cache_bytes: int | None  # the KV cache buffers
    ceiling_gbps: float | None  # the measured copy ceiling
    source: TokensFrom  # where per_step came from
    note: str = ""  # why the counted bytes were set aside
    # the napkin math: tokens a step up to which reading the weights bounds it (their bytes a
    # parameter x the matmul ceiling / (2 FLOPs a parameter a token x the copy ceiling))
    batch_bound: float | None = None
    sequences: int | None = None  # the KV cache's batch: the sequences a step serves

    @property
    def ttft_ms(self) -> float | None:
        """A prefill's time to first token: the step that reads the prompt, several tokens a
        sequence, makes each sequence's first token (None for a decode step, or unknown)."""
        return self.step_ms if self.sequences and self.per_step > self.sequences else None

    @property
    def tokens_per_s(self) -> float:
        return self.per_step / self.step_ms * 1e3

    @property
    def ms_per_token(self) -> float:
        return self.step_ms / self.per_step

    @property
    def must_read(self) -> float | None:
        """What a step has to read at the least: every weight once, and the KV cache."""
        if self.weights_bytes is None:
            return None
        return float(self.weights_bytes + (self.cache_bytes or 0))

    @property
    def gbps(self) -> float | None:
        """The rate the step moves its bytes at: counted, else what it must read."""
        moved = self.bytes_per_step or self.must_read
        return moved / self.step_ms / 1e6 if moved else None

    @property
    def share(self) -> float | None:
        return self.gbps / self.ceiling_gbps if self.gbps and self.ceiling_gbps else None

    @property
    def floor_ms(self) -> float | None:
        """The step's time at the copy ceiling: the bytes it must move, at that rate."""
        moved = self.bytes_per_step or self.must_read
        return moved / self.ceiling_gbps / 1e6 if moved and self.ceiling_gbps else None

    def to_dict(self) -> dict:
        return {
            "tokens_per_step": self.per_step,
            "tokens_from": self.source.value,
            "tokens_per_s": self.tokens_per_s,
            "ms_per_token": self.ms_per_token,
            "bytes_per_token": self.bytes_per_step / self.per_step if self.bytes_per_step else None,
            "weights_bytes": self.weights_bytes,
            "cache_bytes": self.cache_bytes,
            "must_read_bytes": self.must_read,
            "gbps": self.gbps,
            "ceiling_gbps": self.ceiling_gbps,
            "bandwidth_share": self.share,
            "floor_ms": self.floor_ms,
            "sequences": self.sequences,
            "ttft_ms": self.ttft_ms,
        }

    def lines(self) -> list[str]:
        """What a user reads: the rate, the bytes, the share of the ceiling and the headroom."""
        out = [
            f"per token: {self.per_step} token(s) a step ({self.source.said}): "
            f"{self.tokens_per_s:,.1f} tokens/s, {self.ms_per_token:.3f} ms a token"
        ]
        if self.ttft_ms is not None:
            out.append(
                f"  time to first token: {self.ttft_ms:.3f} ms (a prefill: "
                f"{self.per_step / self.sequences:g} prompt tokens a sequence read in one step)"
            )
        parts = []
        if self.bytes_per_step:
            parts.append(f"{_size(self.bytes_per_step / self.per_step)} moved a token (counted over its ops)")
        if self.must_read is not None:
            kv = f" + KV cache {_size(self.cache_bytes)}" if self.cache_bytes else ""
            ratio = f", {self.bytes_per_step / self.must_read:.2f}x that" if self.bytes_per_step else ""
            parts.append(f"it must read weights {_size(self.weights_bytes)}{kv} a step{ratio}")
        if parts:
            out.append("  " + "; ".join(parts))
        if self.note:
            out.append(f"  ({self.note})")
        if self.share is not None:
            out.append(
                f"  {self.gbps:,.1f} GB/s: {self.share:.0%} of the measured copy ceiling "
                f"({self.ceiling_gbps:,.0f} GB/s); at the ceiling {self.floor_ms:.3f} ms a step, "
                f"{self.tokens_per_s * self.step_ms / self.floor_ms:,.0f} tokens/s "
                f"(headroom {max(self.step_ms - self.floor_ms, 0.0):.3f} ms a step)"
            )
        if self.batch_bound and self.per_step < self.batch_bound / 2:
            out.append(
                f"  napkin math: a step reads its weights once for all its tokens, so up to ~"
                f"{self.batch_bound:,.0f} tokens a step (a larger batch) the read bounds it and tokens/s "
                "grows about as the batch; past that the matmuls' FLOPs do"
            )
        return out


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def weights_matmul(models: dict, ceilings: dict) -> tuple[int, float] | None:
    """(bytes a parameter, the matmul TFLOP/s ceiling) of the dtype most of the weights' bytes
    are in; None where neither is known."""
    import torch

    dtypes = models.get("dtypes") or {}
    main = max(dtypes, key=dtypes.get, default=None)
    dtype = getattr(torch, main, None) if main else None
    flops = matmul_ceiling(ceilings, main) if dtype else None
    return (dtype.itemsize, flops) if flops else None


def batch_bound(models: dict, ceilings: dict) -> float | None:
    """B* = bytes a parameter x FLOP/s / (2 FLOPs a parameter a token x bytes/s): the tokens a
    step where the matmuls' time reaches the weights' read time."""
    main, copy = weights_matmul(models, ceilings), ceilings.get("copy_gbps")
    if not main or not copy:
        return None
    itemsize, flops = main
    return itemsize * flops * 1e12 / (2 * copy * 1e9)


def model_bytes(model) -> dict:
    """{"weights": the parameters a forward reads whole (an embedding table's rows are looked up,
    not read: it counts only where another module shares it, a tied output head), "cache": the
    buffers named like a cache (KV caches), "batch": the caches' first dimension}."""
    import torch

    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    shared = {
        id(p)
        for m in model.modules()
        if not isinstance(m, torch.nn.Embedding)
        for p in m.parameters(recurse=False)
    }
    caches = [b for name, b in model.named_buffers() if "cache" in name.rsplit(".", 1)[-1].lower()]
    dtypes: dict[str, int] = {}
    for p in model.parameters():
        if id(p) not in tables or id(p) in shared:
            key = str(p.dtype).removeprefix("torch.")
            dtypes[key] = dtypes.get(key, 0) + p.numel() * p.element_size()
    return {
        "weights": sum(dtypes.values()),
        "dtypes": dtypes,  # the weights' bytes by dtype ("float32": ...)
        "cache": sum(b.numel() * b.element_size() for b in caches),
        "batch": caches[0].shape[0] if caches and caches[0].dim() >= 1 else None,
    }


def tokens_per_step(c, given: int | None = None) -> tuple[int, TokensFrom] | None:
    """The tokens a step of capture `c` takes in: `given` (--tokens), else its first embedding
    lookup's indices, else its KV cache's batch; None where none is known (not a generation step)."""
    model = c.model or {}
    for n, source in (
        (given, TokensFrom.GIVEN),
        (model.get("tokens"), TokensFrom.EMBEDDING),
        (model.get("batch"), TokensFrom.CACHE_BATCH),
    ):
        if n:
            return int(n), source
    return None


def training_step(capture) -> bool:
    """Whether the step trains: its ops run backward or step an optimizer. Its embedding's input
    is a batch of training tokens, not tokens it generates."""
    items = getattr(capture, "items", ())  # a capture read for its work alone holds no ops
    return any(i.phase in ("backward", "optimizer") for i in items)


def read(capture, ceilings: dict, given: int | None = None) -> Tokens | None:
    """The step read per token (tokens_per_step says how many), against what its models must
    read (capture.model) and the copy ceiling; None where it is not a generation step: a
    training step (one that runs backward or steps an optimizer) reads no tokens unless `given`."""
    if given is None and training_step(capture):
        return None
    found = tokens_per_step(capture, given)
    if found is None:
        return None
    models, ceilings = capture.model or {}, ceilings or {}
    moved, note = None, ""
    if capture.work:
        moved = sum(w[1] for w in capture.work.values()) / max(capture.calls, 1)
    must = (models.get("weights") or 0) + (models.get("cache") or 0)
    if moved is not None and must and moved < 0.5 * must:
        note = (
            f"the ops counted moved {_size(moved)} a step, under half of the weights: a CUDA graph's "
            "replay runs ops the counter does not see; the rate is read from what it must read"
        )
        moved = None
    return Tokens(
        per_step=found[0],
        # the step's wall time, or its device time where that is longer: a host that runs
        # ahead (a graph replay returns at once) does not make the device faster
        step_ms=capture.step_ms,
        bytes_per_step=moved or None,
        weights_bytes=models.get("weights"),
        cache_bytes=models.get("cache"),
        ceiling_gbps=ceilings.get("copy_gbps"),
        source=found[1],
        note=note,
        batch_bound=batch_bound(models, ceilings),
        sequences=models.get("batch"),
    )
