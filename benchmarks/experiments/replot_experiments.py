"""Draw the plots of experiments stored without them, from their stored tables, and
render the report again.

The H200 run of 2026-11-30 (benchmarks/results/2026-11-30-h200-run6-report/) stored
launch-overhead, sync-pitfall, lm-step and matmul-dispatch before they drew plots; each
now draws them from its own table rows, so the recorded numbers can be drawn as they are:

    python3 benchmarks/experiments/replot_experiments.py benchmarks/results/2026-11-30-h200-run6-report
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

from perfloop.experiments import dispatch, lm, pitfalls
from perfloop.results.report import render_html
from perfloop.results.store import Store

FROM_TABLE = {
    "launch-overhead": pitfalls.plot_launch_overhead,
    "sync-pitfall": pitfalls.plot_sync_pitfall,
    "lm-step": lm.plot_lm_step,
    "matmul-dispatch": dispatch.plot_matmul_dispatch,
}


def main(folder: str) -> None:
    out = Path(folder)
    db = out / "perfloop.db"
    con = sqlite3.connect(db)
    stored = con.execute("SELECT id, payload FROM artifacts WHERE kind = 'experiment'").fetchall()
    for art_id, payload in stored:
        p = json.loads(payload)
        draw = FROM_TABLE.get(p.get("name"))
        if draw is None or p.get("plots"):
            continue
        drawn = draw(p["table"]["rows"], out)
        paths = drawn if isinstance(drawn, list) else [drawn]
        p["plots"] = [Path(x).name for x in paths]
        p["plot_paths"] = [str(x) for x in paths]
        p["plots_drawn_later"] = "from the stored table, by benchmarks/experiments/replot_experiments.py"
        con.execute("UPDATE artifacts SET payload = ? WHERE id = ?", (json.dumps(p), art_id))
        print(f"{p['name']}: {', '.join(p['plots'])}")
    con.commit()
    con.close()
    print("report:", render_html(Store(db), out))


if __name__ == "__main__":
    main(sys.argv[1])
