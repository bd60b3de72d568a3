"""A generation step read per token: tokens/s and ms a token, the bytes a token moves (counted
over the step's ops) beside what it must read (the weights and the KV cache), and their rate
against the measured copy ceiling -- the figure that bounds a decode step, which reads every
weight once to make one token per sequence.

>>> t = Tokens(per_step=1, step_ms=2.0, bytes_per_step=6e9 * 2e-3, weights_bytes=11e6, cache_bytes=1e6,
...            ceiling_gbps=8.0, source="given")
>>> round(t.tokens_per_s), round(t.gbps, 1), round(t.share, 2), round(t.floor_ms, 2)
(500, 6.0, 0.75, 1.5)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tokens:
    per_step: int  # tokens one step makes (a decode step: one a sequence) or takes in (a prefill)
    step_ms: float  # the step's wall time
    bytes_per_step: float | None  # counted over the step's ops: each op's reads and writes
    weights_bytes: int | None  # the model's parameters a step reads (not embedding tables: rows)
    cache_bytes: int | None  # the KV cache buffers
    ceiling_gbps: float | None  # the measured copy ceiling
    source: str  # where per_step came from: "given", "embedding input", "cache batch"
    note: str = ""  # why the counted bytes were set aside
    # the napkin math: tokens a step up to which reading the weights bounds it (their bytes a
    # parameter x the matmul ceiling / (2 FLOPs a parameter a token x the copy ceiling))
    batch_bound: float | None = None

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
            "tokens_from": self.source,
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
        }

    def lines(self) -> list[str]:
        """What a user reads: the rate, the bytes, the share of the ceiling and the headroom."""
        how = {
            "given": "--tokens",
            "embedding input": "the embedding's input",
            "cache batch": "the KV cache's batch: one token a sequence; --tokens N to say otherwise",
        }[self.source]
        out = [
            f"per token: {self.per_step} token(s) a step ({how}): {self.tokens_per_s:,.1f} tokens/s, "
            f"{self.ms_per_token:.3f} ms a token"
        ]
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


MATMUL_CEILING = {  # the weights' dtype -> (its matmul ceiling, bytes a parameter)
    "bfloat16": ("matmul_bf16_tflops", 2),
    "float16": ("matmul_fp16_tflops", 2),
    "float32": ("matmul_fp32_tflops", 4),
}


def _batch_bound(models: dict, ceilings: dict) -> float | None:
    """B* = bytes a parameter x FLOP/s / (2 FLOPs a parameter a token x bytes/s): the tokens a
    step where the matmuls' time reaches the weights' read time."""
    dtypes = models.get("dtypes") or {}
    main = max(dtypes, key=dtypes.get, default=None)
    key, per = MATMUL_CEILING.get(main, (None, 0))
    flops, copy = ceilings.get(key) if key else None, ceilings.get("copy_gbps")
    if not flops or not copy:
        return None
    return per * flops * 1e12 / (2 * copy * 1e9)


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
    weights = sum(
        p.numel() * p.element_size() for p in model.parameters() if id(p) not in tables or id(p) in shared
    )
    caches = [b for name, b in model.named_buffers() if "cache" in name.rsplit(".", 1)[-1].lower()]
    dtypes: dict[str, int] = {}
    for p in model.parameters():
        if id(p) not in tables or id(p) in shared:
            key = str(p.dtype).removeprefix("torch.")
            dtypes[key] = dtypes.get(key, 0) + p.numel() * p.element_size()
    return {
        "weights": weights,
        "dtypes": dtypes,  # the weights' bytes by dtype ("float32": ...)
        "cache": sum(b.numel() * b.element_size() for b in caches),
        "batch": caches[0].shape[0] if caches and caches[0].dim() >= 1 else None,
    }


def read(capture, ceilings: dict, given: int | None, seen: int | None, models: dict | None) -> Tokens | None:
    """The step read per token: tokens a step from `given` (--tokens), else `seen` (the first
    embedding lookup's indices in a profiled step), else the KV cache's batch; None where none
    of those is known (a step that is not a generation step)."""
    models = models or {}
    per_step, source = given, "given"
    if per_step is None and seen:
        per_step, source = seen, "embedding input"
    if per_step is None and models.get("batch"):
        per_step, source = int(models["batch"]), "cache batch"
    if not per_step:
        return None
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
        batch_bound=_batch_bound(models, ceilings or {}),
        per_step=int(per_step),
        # the step's wall time, or its device time where that is longer: a host that runs
        # ahead (a graph replay returns at once) does not make the device faster
        step_ms=capture.step_ms,
        bytes_per_step=moved or None,
        weights_bytes=models.get("weights"),
        cache_bytes=models.get("cache"),
        ceiling_gbps=(ceilings or {}).get("copy_gbps"),
        source=source,
        note=note,
    )
