"""Where an iteration of UniLab's off-policy runner goes, from the Perfetto timeline UniLab writes
with `training.trace_enabled=true` (`perfetto_offpolicy_timeline.json`, written when a training
ends at its last iteration; an interrupted one writes none).

Why: on the H200 of 2026-12-07 a compiled U64 iteration took 36.6-41.3 ms of wall clock against an
update phase of 33.5 ms on the GPU (results/time_to_reward/run_ahead_warm_seeds_h200_2026-12-07/), and
UniLab's own iteration timer leaves out what its learner thread does after the update phase. Its
timeline has every slice of the learner thread (wait for the collector's request, inference, replay
sample, update phase, reward statistics) and of the collector (env step, wait for the action).

    python experiments/report/runner_timeline.py TRACE.json [--last 300] [--output summary.json]

Per iteration (from one `learner/update_phase` start to the next, the last --last of them), in ms:
the period; the learner thread's time in each top-level slice kind inside the period (its wait for
the collector's request holds the inference it serves, also given alone) and what is in none of
them ("learner, outside UniLab's slices": logging, bookkeeping, Python); the collector's env step
and wait for the learner's action that started in the period. Medians and p90.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from pathlib import Path

UPDATE = "learner/update_phase"
# the learner thread's top-level slices: they do not overlap, so what a period holds beyond them is the
# thread's time outside UniLab's slices (learner/training_e2e spans the whole run)
LEARNER_SLICES = ("learner/wait_for_data", "learner/update_reward_stats", "learner/replay_sample", UPDATE)
# slices inside learner/wait_for_data: serving the collector's request (the wait itself is the rest)
LEARNER_NESTED = ("learner/inference", "learner/inference_response")
COLLECTOR_SLICES = ("collector/env_step", "collector/wait_for_learner_action", "collector/inference_request", "collector/replay_add")


def events_of(trace: dict | list) -> list[dict]:
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _stats(values: list[float]) -> dict:
    ordered = sorted(values)
    if not ordered:
        return {"median": None, "p90": None, "count": 0}
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return {"median": median, "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], "count": len(ordered)}


def breakdown(trace: dict | list, last: int = 300) -> dict:
    slices = [e for e in events_of(trace) if e.get("ph") == "X"]
    updates = sorted((e for e in slices if e["name"] == UPDATE), key=lambda e: e["ts"])
    if len(updates) < 2:
        raise ValueError(f"the timeline has {len(updates)} '{UPDATE}' slice(s): at least two are needed for one period")
    learner_tid = (updates[0]["pid"], updates[0]["tid"])
    by_name: dict[str, list[dict]] = {}
    for e in slices:
        by_name.setdefault(e["name"], []).append(e)
    starts = {name: sorted(e["ts"] for e in evs) for name, evs in by_name.items()}
    ordered = {name: sorted(evs, key=lambda e: e["ts"]) for name, evs in by_name.items()}

    def inside(name: str, t0: float, t1: float) -> list[dict]:
        """The slices named so that start in [t0, t1)."""
        s = starts.get(name, [])
        return ordered[name][bisect.bisect_left(s, t0):bisect.bisect_left(s, t1)] if s else []

    periods = list(zip(updates[:-1], updates[1:]))[-last:]
    rows = {"period": [], "learner, outside UniLab's slices": []}
    for name in (*LEARNER_SLICES, *LEARNER_NESTED, *COLLECTOR_SLICES):
        rows[name] = []
    for this, following in periods:
        t0, t1 = this["ts"], following["ts"]
        rows["period"].append((t1 - t0) / 1000.0)
        covered = 0.0
        for name in (*LEARNER_SLICES, *LEARNER_NESTED):
            # a slice's share inside the period (a slice that started in the period before is clipped)
            ms = sum(min(e["ts"] + e["dur"], t1) - max(e["ts"], t0) for e in ordered.get(name, [])[
                max(0, bisect.bisect_left(starts.get(name, []), t0) - 1):bisect.bisect_left(starts.get(name, []), t1)]
                if (e["pid"], e["tid"]) == learner_tid and e["ts"] + e["dur"] > t0) / 1000.0
            rows[name].append(ms)
            covered += ms if name in LEARNER_SLICES else 0.0
        rows["learner, outside UniLab's slices"].append(max((t1 - t0) / 1000.0 - covered, 0.0))
        for name in COLLECTOR_SLICES:
            rows[name].append(sum(e["dur"] for e in inside(name, t0, t1)) / 1000.0)
    return {
        "what": "per iteration of UniLab's runner (one learner/update_phase start to the next), ms, from its Perfetto timeline",
        "iterations": len(periods),
        "first_iteration": periods[0][0].get("args", {}).get("iteration"),
        "last_iteration": periods[-1][0].get("args", {}).get("iteration"),
        "ms": {name: _stats(values) for name, values in rows.items() if any(values)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--last", type=int, default=300, help="the last N iterations (default 300)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    try:
        summary = breakdown(json.loads(args.trace.read_text()), args.last)
    except (ValueError, KeyError) as exc:
        print(f"runner_timeline: {args.trace}: {exc}", file=sys.stderr)
        return 2
    summary["trace"] = str(args.trace)
    text = json.dumps(summary, indent=1)
    if args.output:
        args.output.write_text(text + "\n")
    print("\n".join(f"{name:45s} {s['median']:8.3f} {s['p90']:8.3f}" for name, s in summary["ms"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
