"""What one child run of perfloop tune is asked to do: the boundary between tune (the parent)
and workflows.tune.child, crossed as JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass(frozen=True)
class RunSpec:
    """What one child run is asked to do (workflows.tune.child reads it as JSON): the script and
    its arguments, the steps to time after a warm-up, what a step is (`range`: a range's name,
    or step_sources.MODEL_CALL; None: optimizer steps), the candidates applied, and how it runs."""

    script: str
    argv: list[str] = field(default_factory=list)
    steps: int = 20
    warmup: int = 5
    range: str | None = None
    mode: str = "run"  # or "profile": the script's profile and diagnosis
    candidates: list[str] = field(default_factory=list)
    seed_offset: int = 0  # added to every seed the script sets (another equally good run)
    dropout: str = "on"  # "off": the first check_steps with the model's dropout off
    check_steps: int = 0
    sites: bool = False  # record where the script builds its model and optimizer (sites.py)

    @property
    def checked_steps(self) -> int:
        """The steps run with dropout off before the timed ones."""
        return self.check_steps if self.dropout == "off" else 0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, data: dict) -> RunSpec:
        """From its JSON (the transport's own keys, `out` and `keep`, set aside)."""
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names - {"out", "keep"}
        if unknown:
            raise ValueError(f"spec: unknown keys {sorted(unknown)}; a RunSpec has {sorted(names)}")
        return cls(**{k: v for k, v in data.items() if k in names})
