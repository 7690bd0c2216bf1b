"""The verdict table of a chaos run: ``python -m tests.chaos.report RESULTS.jsonl OUT.txt``.

Each line of RESULTS is one scenario run (written by the tests when ``$CHAOS_RESULTS`` is
set): scenario, variant, outcome, the checker's per-property verdicts, timings.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any

#: Columns of the table, in order: short header -> property.
COLUMNS = {
    "ovl": "overlap",
    "ovl-v": "overlap_in_validity",
    "stale": "stale_write_accepted",
    "f-ord": "fence_order",
    "t-ord": "token_order",
    "lost-f": "lost_update_fenced",
    "lost-u": "lost_update_unfenced",
    "take": "takeover",
    "calls": "call_timing",
    "noQ": "no_quorum_run",
    "fin": "finished",
    "recov": "recovered",
    "beat": "beat_once",
}

LEGEND = """\
Each cell: violations found, then the verdict against what the scenario expects:
  ok     = expected none, found none (a gate that held)
  FAIL   = expected none, found some
  shown  = expected some (negative control, or a fault outside Redlock's assumptions)
           and the checker showed it
  MISSED = expected some, found none (the scenario would prove nothing)
  .      = reported only (count shown), or not applicable (-)
Variants: correct = the real lock, fencing on; nofence = the real lock, store accepting
stale fences; broken = plain-DEL release, no validity check, no renewal, fencing off;
broken+fence = the broken lock, fencing on; noquarantine = restart_quarantine=0.
takeover cells: violations/worst ms; calls cells: violations/worst round ms.
"""


def _cell(verdict: dict[str, Any] | None) -> str:
    if verdict is None or not verdict.get("applicable", True):
        return "-"
    n = verdict["violations"]
    label = {"PASS": "ok", "FAIL": "FAIL", "SHOWN": "shown", "MISSED": "MISSED", "info": "."}[
        verdict["label"]
    ]
    text = f"{n}{label if label != '.' else ''}" if label in ("ok", ".") else f"{n} {label}"
    if verdict.get("measure") is not None:
        text += f"/{verdict['measure']:.0f}"
    return text


def write_table(results: Path, out: Path) -> str:
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    header = ["scenario", "variant", "result", "secs", *COLUMNS]
    table = [header]
    for row in rows:
        verdicts = row.get("verdicts", {})
        table.append(
            [
                row["scenario"],
                row["variant"],
                row["outcome"],
                f"{row.get('seconds', 0):.0f}",
                *(_cell(verdicts.get(prop)) for prop in COLUMNS.values()),
            ]
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=False)) for r in table]
    titles = {row["scenario"]: row.get("title", "") for row in rows}
    total = sum(row.get("seconds", 0) for row in rows)
    failed = [f"{r['scenario']}[{r['variant']}]" for r in rows if r["outcome"] != "passed"]
    text = "\n".join(
        [
            "celery-redlock chaos matrix: verdicts of the last full run (scripts/chaos.sh)",
            (
                f"run at {rows[0]['at'] if rows else '?'} .. {rows[-1]['at'] if rows else '?'} on "
                f"{platform.node()} ({platform.system()} {platform.release()}), "
                f"python {platform.python_version()}; {len(rows)} runs, {total:.0f} s of scenarios"
            ),
            f"outcome: {'ALL PASSED' if not failed else 'FAILED: ' + ', '.join(failed)}",
            "",
            *lines,
            "",
            "Scenarios:",
            *(f"  {sid:8} {title}" for sid, title in titles.items()),
            "",
            LEGEND,
        ]
    )
    out.write_text(text + "\n")
    return text


if __name__ == "__main__":
    sys.stdout.write(write_table(Path(sys.argv[1]), Path(sys.argv[2])) + "\n")
