"""The learner's own checkpoint: every tensor of its state, copied out and loaded back in place.

Loading copies into the live tensors (``copy_``), never rebinds them: compiled functions and a
captured graph read those tensors by address and stay valid across a load. UniLab's checkpoint
layout is converted in ``flashsac_opt.unilab.compat``.
"""

from __future__ import annotations

from dataclasses import asdict

import torch


STATE_FORMAT = "flashsac_opt/1"


def _plain(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in d.items()}


def learner_state_dict(learner) -> dict:
    return {
        "format": STATE_FORMAT,
        "dims": dict(learner.dims),
        "config": asdict(learner.cfg),
        "actor": _plain(learner.actor.state_dict()),
        "critic": _plain(learner.critic.state_dict()),
        "target_critic": _plain(learner.target_critic.state_dict()),
        "temperature": _plain(learner.temperature.state_dict()),
        "optim": {
            "actor": _plain(learner.actor_adam.tensors()),
            "critic": _plain(learner.critic_adam.tensors()),
            "temperature": _plain(learner.temperature_adam.tensors()),
        },
        "reward_normalizer": _plain(learner.reward_normalizer.state_tensors()) if learner.reward_normalizer else None,
        "skipped_totals": learner.totals.clone(),
        "iterations": learner.iterations,
    }


def load_learner_state(learner, state: dict) -> None:
    if state.get("format") != STATE_FORMAT:
        raise ValueError(
            f"not a flashsac_opt learner state (format {state.get('format')!r}); "
            "convert UniLab checkpoints with flashsac_opt.unilab.compat.from_unilab_state_dict"
        )
    if state["dims"] != learner.dims:
        raise ValueError(f"checkpoint dims {state['dims']} do not match this learner's {learner.dims}")
    with torch.no_grad():
        learner.actor.load_state_dict(state["actor"])
        learner.critic.load_state_dict(state["critic"])
        learner.target_critic.load_state_dict(state["target_critic"])
        learner.temperature.load_state_dict(state["temperature"])
        adams = ((learner.actor_adam, "actor"), (learner.critic_adam, "critic"), (learner.temperature_adam, "temperature"))
        for adam, key in adams:
            for name, tensor in adam.tensors().items():
                tensor.copy_(state["optim"][key][name])
        for step in (learner.actor_step, learner.critic_step, learner.temperature_step):
            step.refresh()  # the next step's Adam coefficients, from the loaded counters
        if learner.reward_normalizer is not None and state.get("reward_normalizer") is not None:
            learner.reward_normalizer.load_state_tensors(state["reward_normalizer"])
        if "skipped_totals" in state:
            learner.totals.copy_(state["skipped_totals"])
    learner.iterations = int(state.get("iterations", 0))
