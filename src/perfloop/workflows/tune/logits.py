"""What a generation run's model chose at each call, for the token check (verify.judge_tokens):
the logits read wherever the model puts them (a tensor; the first such in a tuple or list; a
dict's or a Hugging Face ModelOutput's `logits`; an object's `.logits`, as a dataclass has), and
at each position (each row of each call's logits, in turn) the greedy token, the TOP largest
logits with their tokens and the logits' scale (the largest |logit|). Kept on the device and
read once at the end (no sync per call), at most MAX_TOKENS positions: about 110 bytes each
(TOP float32 values and int64 tokens, the argmax, the scale), 450 KB at most."""

from __future__ import annotations

from collections.abc import Mapping

MAX_TOKENS = 4096  # positions kept for the check
TOP = 8  # the largest logits kept per position: the script's margin to any of them is known


def find_logits(out):
    """The logits in a model's output (a floating tensor whose last dimension is a vocabulary),
    or None."""
    import torch

    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() and out.dim() > 0 and out.shape[-1] > 1 else None
    if isinstance(out, (tuple, list)):  # (logits, loss), (loss, logits, past_key_values)
        return next((t for t in out if isinstance(t, torch.Tensor) and find_logits(t) is not None), None)
    if isinstance(out, Mapping):  # a dict; transformers' ModelOutput is an OrderedDict
        return find_logits(out.get("logits"))
    got = getattr(out, "logits", None)
    return find_logits(got) if isinstance(got, torch.Tensor) else None


def describe(out) -> str:
    """A model output that holds no logits, in words: what the report says was not checked."""
    import torch

    if isinstance(out, torch.Tensor):
        return f"a {out.dtype} tensor of shape {tuple(out.shape)}, not logits over a vocabulary"
    if isinstance(out, Mapping):
        return f"a {type(out).__name__} with keys {list(out)[:6]}, none of them logits over a vocabulary"
    if isinstance(out, (tuple, list)):
        kinds = [type(x).__name__ for x in out[:6]]
        return f"a {type(out).__name__} of {kinds}, none of them logits over a vocabulary"
    return f"a {type(out).__name__}, with no logits"


class LogitsRecord:
    """Each model call's choices, on the device until `readings()`."""

    def __init__(self, limit: int = MAX_TOKENS):
        self.limit = limit
        self.kept = 0
        self.parts: list[tuple] = []  # per call: (argmax, top values, top tokens, scale)
        self.calls: list[int] = []  # the positions each recorded call kept
        self.dtype: str | None = None
        self.missing: str | None = None  # the first output seen without logits

    def add(self, out) -> int:
        """Record one call's output; returns the positions its logits have (0: none read)."""
        import torch

        logits = find_logits(out)
        if logits is None:
            self.missing = self.missing or describe(out)
            return 0
        positions = logits.shape[:-1].numel()
        room = self.limit - self.kept
        if room > 0:
            rows = logits.detach().reshape(-1, logits.shape[-1])[:room]
            top = rows.topk(min(TOP, rows.shape[-1]), dim=-1)
            low, high = torch.aminmax(rows, dim=-1)  # no |rows| copy of a prefill's logits
            scale = torch.maximum(low.abs(), high.abs()).float()
            self.parts.append((rows.argmax(-1), top.values.float(), top.indices, scale))
            self.calls.append(rows.shape[0])
            self.kept += rows.shape[0]  # shapes are known on the host: no sync
            self.dtype = self.dtype or str(logits.dtype)
        return positions

    def readings(self) -> dict:
        """The child's result keys (verify.Logits.of reads them back)."""

        def column(k: int) -> list:
            return [x for part in self.parts for x in part[k].tolist()]

        return {
            "tokens": column(0),  # each position's greedy token
            "top_logits": column(1),  # each position's TOP largest logits, largest first
            "top_tokens": column(2),  # their tokens
            "logit_scale": column(3),  # each position's largest |logit|
            "logits_dtype": self.dtype,
            "logit_calls": self.calls,  # the positions each model call added, in turn
            "logits_missing": None if self.parts else (self.missing or "the model was never called"),
        }
