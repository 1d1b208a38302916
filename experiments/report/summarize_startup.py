"""Launch -> first learner update of real UniLab trainings, one JSON: each run's first-update
time (``rows_all[0].wall_s`` of benchmark_flashsac_training's JSON), learner and iteration
medians, the Inductor cache at launch, and what the compile-ahead child reported in the
training's log ("compile-ahead child done in X s; the first update waited Y s").

    python experiments/report/summarize_startup.py --run NAME=TRAINING.json[:LOG_ARCHIVE:MEMBER] ... \\
        --output results/startup/startup_summary.json

A run whose training logged no iteration has no JSON: give it as NAME=-:ARCHIVE:MEMBER, and
the summary keeps what its log says (the child's times, the time limit that stopped it).
"""

from __future__ import annotations

import argparse
import json
import re
import tarfile
from pathlib import Path

CHILD = re.compile(r"compile-ahead child done in (?P<child>[\d.]+) s; the first update waited (?P<waited>[\d.]+) s")
STOPPED = re.compile(r"--time-limit (?P<limit>[\d.]+) s reached")


def log_text(archive: Path, member: str) -> str:
    with tarfile.open(archive) as tar:
        return tar.extractfile(member).read().decode(errors="replace")


def summarize_run(training: str, archive: str | None, member: str | None) -> dict:
    row: dict = {"training_json": None if training == "-" else training}
    if training != "-":
        data = json.loads(Path(training).read_text())
        first = data["rows_all"][0]
        row.update(
            first_update_s=first["wall_s"],
            learner_ms_median=data["learner_train_ms"]["median"],
            learner_ms_p90=data["learner_train_ms"]["p90"],
            iteration_ms_median=data["iter_ms"]["median"],
            iterations_logged=data["iterations_logged"],
            inductor_cache_at_launch=data["inductor_cache_at_launch"],
            environment={k: data["environment"].get(k) for k in ("gpu", "torch", "date", "cpu_cores_usable", "run_note")},
        )
    if archive:
        text = log_text(Path(archive), member)
        row["log"] = f"{archive}:{member}"
        child = CHILD.search(text)
        if child:
            row["compile_ahead_child_s"] = float(child["child"])
            row["compile_ahead_waited_s"] = float(child["waited"])
        stopped = STOPPED.search(text)
        row["stopped_by_time_limit_s"] = float(stopped["limit"]) if stopped else None
        row["logged_an_iteration"] = training != "-"
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True, metavar="NAME=JSON[:ARCHIVE:MEMBER]")
    parser.add_argument("--note", default="", help="how the runs were made (host, order, caches)")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    runs = {}
    for spec in args.run:
        name, _, rest = spec.partition("=")
        parts = rest.split(":")
        if not name or len(parts) not in (1, 3):
            parser.error(f"--run {spec!r}: expected NAME=JSON or NAME=JSON:ARCHIVE:MEMBER")
        runs[name] = summarize_run(parts[0], *(parts[1:] if len(parts) == 3 else (None, None)))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"experiment": "startup", "note": args.note, "runs": runs}, indent=1) + "\n")
    print(f"{len(runs)} runs -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
