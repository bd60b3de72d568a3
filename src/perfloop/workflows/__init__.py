"""The workflows the CLI, the demo and scripts share, with typed arguments: bench an op's
variants (checked, then timed interleaved), sweep them over sizes, profile one, record a run,
and run collectives or a sweep across ranks (comm)."""
