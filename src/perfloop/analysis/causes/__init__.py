"""The causes a step's diagnosis looks for: one module each, one analyzer each,
`find(capture, ceilings) -> list[Finding]`, listed once below. A new cause is a new module here
and one line in ANALYZERS (and its Kind).

Where two could count the same time, the later one asks the earlier what it explains (the ops
finding leaves out the fused runs', the written-out attention's and the data preparation's ops:
`fusion.covered`, `attention.covered`, `data_prep.items`), so each analyzer reads the capture
alone and the order below is only the order the findings are made in; the ranking sorts them.
"""

from perfloop.analysis.causes import (
    attention,
    compiles,
    conv_layout,
    cudagraph_skips,
    data_prep,
    decode_weights,
    fusion,
    graph_breaks,
    idle,
    kv_cat,
    layout,
    ops,
    optimizer,
    pageable,
    sdpa_math,
    small_batch,
)

ANALYZERS = [
    compiles.find,
    graph_breaks.find,
    cudagraph_skips.find,
    attention.find,
    sdpa_math.find,
    fusion.find,
    pageable.find,
    layout.find,
    conv_layout.find,
    decode_weights.find,
    kv_cat.find,
    small_batch.find,
    data_prep.find,
    optimizer.find,
    ops.find,
    idle.find,
]
