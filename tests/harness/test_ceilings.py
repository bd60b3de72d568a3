import time

import perfloop as pl


def test_ceilings_are_measured_and_cached():
    c1 = pl.ceilings()
    assert c1["copy_gbps"] > 0 and c1["matmul_fp32_tflops"] > 0
    t = time.perf_counter()
    assert pl.ceilings() == c1
    assert time.perf_counter() - t < 0.5  # from the cache
