"""The learner's metrics: a fixed device buffer written inside the iteration, read once after it.

The buffer has one row per update (METRIC_COLUMNS) and a last row of running totals
(TOTAL_COLUMNS): the update functions write their values into their row on the device, so an
iteration never synchronizes with the host; ``unilab_metrics`` turns the one host copy into
UniLab's TensorBoard tags.
"""

from __future__ import annotations

# Columns of a per-update metrics row.
METRIC_COLUMNS = (
    "critic_loss",
    "reward_scale_std",
    "critic_applied",
    "actor_loss",
    "entropy",
    "temperature",
    "temperature_loss",
    "actor_applied",
    "temperature_applied",
)
COL = {name: i for i, name in enumerate(METRIC_COLUMNS)}
# Columns of the running-totals row (last row of the buffer).
TOTAL_COLUMNS = ("critic_skipped", "actor_skipped", "temperature_skipped")


def unilab_metrics(values: list[list[float]], updates_per_step: int, policy_frequency: int,
                   reward_normalized: bool) -> dict[str, float]:
    """UniLab's tags from the host copy of the buffer (``values``: its rows as lists). Like
    UniLab, the losses are those of the last critic update and the last actor update."""
    u_count, pf = updates_per_step, policy_frequency
    rows, totals = values[:u_count], values[u_count]
    last_critic = rows[-1]
    last_actor = rows[((u_count - 1) // pf) * pf]
    out = {"Loss/critic": last_critic[COL["critic_loss"]]}
    if reward_normalized:
        out["Train/reward_scale_std"] = last_critic[COL["reward_scale_std"]]
    out.update(
        {
            "Loss/actor": last_actor[COL["actor_loss"]],
            "Loss/entropy": last_actor[COL["entropy"]],
            "Policy/temperature": last_actor[COL["temperature"]],
            "Loss/temperature": last_actor[COL["temperature_loss"]],
            "Learner/critic_updates_skipped": float(sum(1.0 - r[COL["critic_applied"]] for r in rows)),
            "Learner/actor_updates_skipped": float(sum(1.0 - rows[i][COL["actor_applied"]] for i in range(0, u_count, pf))),
            "Learner/skipped_total": float(sum(totals[: len(TOTAL_COLUMNS)])),
        }
    )
    return out
