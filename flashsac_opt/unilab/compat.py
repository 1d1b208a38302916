"""State-dict mapping between UniLab 1.5.2's FlashSACLearner and flashsac_opt.

UniLab keeps one tensor per layer (``embedder.norm.weight``, ``encoder.0.w1.w.weight``,
...) and one Adam state per tensor; flashsac_opt keeps one flat buffer per network. The
mapping is a fixed name table plus the flat layouts; both directions are exact copies.
It needs no UniLab import: the UniLab side is described by names only.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from flashsac_opt.checkpoint import STATE_FORMAT
from flashsac_opt.learner import FlashSACLearner

UNILAB_ACTOR_BUILDER = "unilab.rl.algos.flash_sac.network:FlashSACActor"


def _unilab_names(num_blocks: int, kind: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(param pairs, stat pairs) as (flashsac_opt slot, UniLab key), in UniLab parameter order.

    UniLab's actor wraps each linear in a UnitLinear (``w.w.weight``); its ensemble critic
    holds the weight directly (``w.weight``).
    """
    linear = ".w.weight" if kind == "actor" else ".weight"
    params = [("in_bn.weight", "embedder.norm.weight"), ("in_bn.bias", "embedder.norm.bias"), ("in_proj", "embedder.w" + linear)]
    stats = [("in_bn.mean", "embedder.norm.running_mean"), ("in_bn.var", "embedder.norm.running_var")]
    for i in range(num_blocks):
        ours, theirs = f"block{i}", f"encoder.{i}"
        for layer, norm, unilab_layer, unilab_norm in (("up", "up_bn", "w1", "norm1"), ("down", "down_bn", "w2", "norm2")):
            params += [
                (f"{ours}.{layer}", f"{theirs}.{unilab_layer}{linear}"),
                (f"{ours}.{norm}.weight", f"{theirs}.{unilab_norm}.weight"),
                (f"{ours}.{norm}.bias", f"{theirs}.{unilab_norm}.bias"),
            ]
            stats += [
                (f"{ours}.{norm}.mean", f"{theirs}.{unilab_norm}.running_mean"),
                (f"{ours}.{norm}.var", f"{theirs}.{unilab_norm}.running_var"),
            ]
    params.append(("out_rms", "post_norm.weight"))
    # nn.Module lists a module's own parameters before its children's: the heads' biases
    # come before their weight matrices in UniLab's parameter (and optimizer-state) order.
    if kind == "actor":
        params += [
            ("mean.bias", "predictor.mean_bias"),
            ("log_std.bias", "predictor.std_bias"),
            ("mean.weight", "predictor.mean_w.w.weight"),
            ("log_std.weight", "predictor.std_w.w.weight"),
        ]
    else:
        params += [("logits.bias", "predictor.logit_bias"), ("logits.weight", "predictor.logit_w.weight")]
    return params, stats


def _network_to_unilab(module_sd: dict[str, torch.Tensor], layout, stats_layout, names, extra: dict[str, torch.Tensor]):
    params, stats = names
    values: dict[str, torch.Tensor] = {}
    for ours, theirs in params:
        values[theirs] = layout.view(module_sd["params"], ours).clone()
    for ours, theirs in stats:
        values[theirs] = stats_layout.view(module_sd["bn_stats"], ours).clone()
    values.update(extra)
    return values


def _network_from_unilab(sd: dict[str, torch.Tensor], layout, stats_layout, names, device) -> dict[str, torch.Tensor]:
    params, stats = names
    expected = {t for _, t in params} | {t for _, t in stats}
    missing = sorted(expected - set(sd))
    if missing:
        raise ValueError(f"UniLab state dict is missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    flat = torch.zeros(layout.numel, device=device)
    layout.pack({ours: sd[theirs] for ours, theirs in params}, flat)
    flat_stats = torch.zeros(stats_layout.numel, device=device)
    stats_layout.pack({ours: sd[theirs] for ours, theirs in stats}, flat_stats)
    return {"params": flat, "bn_stats": flat_stats}


def _adam_to_unilab(adam_state: dict[str, torch.Tensor], layout, names, lr: float, peak: float, capturable: bool, fused: bool | None) -> dict:
    template = torch.optim.Adam([torch.zeros(1)], lr=peak, fused=fused)
    group = copy.deepcopy(template.state_dict()["param_groups"][0])
    group["capturable"] = capturable
    group.update({"lr": lr, "initial_lr": peak, "params": list(range(len(names)))})
    state: dict[int, dict[str, torch.Tensor]] = {}
    if float(adam_state["step"]) > 0:
        for index, (ours, _theirs) in enumerate(names):
            state[index] = {
                "step": adam_state["step"].to(torch.float32).reshape(()).clone(),
                "exp_avg": layout.view(adam_state["exp_avg"], ours).clone(),
                "exp_avg_sq": layout.view(adam_state["exp_avg_sq"], ours).clone(),
            }
    return {"state": state, "param_groups": [group]}


def _adam_from_unilab(sd: dict, layout, names, device) -> dict[str, torch.Tensor]:
    groups = sd["param_groups"]
    if len(groups) != 1 or len(groups[0]["params"]) != len(names):
        raise ValueError(f"UniLab optimizer state has {sum(len(g['params']) for g in groups)} params, expected {len(names)}")
    exp_avg = torch.zeros(layout.numel, device=device)
    exp_avg_sq = torch.zeros(layout.numel, device=device)
    step = torch.zeros(1, device=device, dtype=torch.float64)
    per_param = sd["state"]
    if per_param:
        steps = set()
        for position, (ours, _theirs) in enumerate(names):
            entry = per_param[groups[0]["params"][position]]
            layout.view(exp_avg, ours).copy_(entry["exp_avg"])
            layout.view(exp_avg_sq, ours).copy_(entry["exp_avg_sq"])
            steps.add(float(entry["step"]))
        if len(steps) != 1:
            raise ValueError(f"UniLab optimizer parameters have different step counts {sorted(steps)}")
        step.fill_(steps.pop())
    return {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "step": step}


def _scheduler_state(schedule, peak: float, last_epoch: int) -> dict[str, Any]:
    optimizer = torch.optim.Adam([torch.zeros(1)], lr=peak)
    # A plain function (like UniLab's closure) so the state dict records lr_lambdas=[None].
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule(step))
    sd = scheduler.state_dict()
    sd["last_epoch"] = last_epoch
    sd["_step_count"] = last_epoch + 1
    sd["_last_lr"] = [peak * schedule(last_epoch)]
    return sd


def actor_semantics(learner: FlashSACLearner) -> dict[str, Any]:
    cfg = learner.cfg
    return {
        "schema_version": 1,
        "kind": "builtin",
        "builder": UNILAB_ACTOR_BUILDER,
        "kwargs": {
            "num_blocks": int(cfg.actor_num_blocks),
            "hidden_dim": int(cfg.actor_hidden_dim),
            "noise_zeta_mu": float(cfg.actor_noise_zeta_mu),
            "noise_zeta_max": int(cfg.actor_noise_zeta_max),
        },
        "obs_dim": int(learner.obs_dim),
        "action_dim": int(learner.action_dim),
        "action_transform": "tanh",
    }


def to_unilab_state_dict(learner: FlashSACLearner, *, capturable: bool | None = None, fused: bool | None = None) -> dict[str, Any]:
    """The learner's state in UniLab 1.5.2's ``FlashSACLearner.get_state_dict()`` layout.

    ``capturable``/``fused`` set the Adam param-group flags UniLab records (its CUDA
    learner uses fused capturable Adam; on CPU both are off). Defaults follow the device.
    """
    cuda = learner.device.type == "cuda"
    capturable = cuda if capturable is None else capturable
    fused = cuda if fused is None else fused
    ours = learner.state_dict()
    cfg = learner.cfg
    a_names, c_names = _unilab_names(cfg.actor_num_blocks, "actor"), _unilab_names(cfg.critic_num_blocks, "critic")
    sched = learner.schedule
    peak = cfg.peak_lr
    out: dict[str, Any] = {
        "actor": _network_to_unilab(ours["actor"], learner.actor.layout, learner.actor.stats_layout, a_names, {"zeta_cdf": ours["actor"]["zeta_cdf"]}),
        "critic": _network_to_unilab(ours["critic"], learner.critic.layout, learner.critic.stats_layout, c_names, {"predictor.support": learner.critic.support.clone()}),
        "target_critic": _network_to_unilab(ours["target_critic"], learner.critic.layout, learner.critic.stats_layout, c_names, {"predictor.support": learner.critic.support.clone()}),
        "temperature": {"log_temp": ours["temperature"]["log_temp"]},
    }
    temp_layout = _TemperatureLayout()
    for key, layout, names in (("actor", learner.actor.layout, a_names[0]), ("critic", learner.critic.layout, c_names[0]), ("temperature", temp_layout, [("log_temp", "log_temp")])):
        state = ours["optim"][key]
        epoch = int(state["schedule_step"])
        out[f"{key}_optimizer"] = _adam_to_unilab(state, layout, names, peak * sched(epoch), peak, capturable, fused)
        out[f"{key}_scheduler"] = _scheduler_state(sched, peak, epoch)
    out["actor_semantics"] = actor_semantics(learner)
    out["obs_normalizer"] = {}  # UniLab saves nn.Identity().state_dict() when obs normalization is off
    rn = ours["reward_normalizer"]
    out["reward_normalizer"] = (
        {"rms": {"mean": rn["mean"], "var": rn["var"], "count": rn["count"]}, "g_r": rn["returns"], "g_r_max": rn["abs_max"]}
        if rn is not None
        else None
    )
    # UniLab never advances update_count; carry through whatever a loaded checkpoint had.
    out["update_count"] = int(learner.unilab_update_count)
    return out


class _TemperatureLayout:
    numel = 1

    @staticmethod
    def view(flat: torch.Tensor, name: str) -> torch.Tensor:
        return flat.view(1)


def from_unilab_state_dict(learner: FlashSACLearner, unilab_sd: dict[str, Any]) -> None:
    """Load a UniLab 1.5.2 learner state (``get_state_dict()`` / ``model_N.pt``) into ``learner``."""
    for key in ("actor", "critic", "target_critic", "temperature", "actor_optimizer", "critic_optimizer", "temperature_optimizer"):
        if key not in unilab_sd:
            raise ValueError(f"not a UniLab FlashSAC learner state: missing {key!r}")
    semantics = unilab_sd.get("actor_semantics")
    expected = actor_semantics(learner)
    if semantics is not None and semantics != expected:
        raise ValueError(f"UniLab checkpoint actor semantics {semantics} do not match this learner ({expected})")
    cfg, device = learner.cfg, learner.device
    a_names, c_names = _unilab_names(cfg.actor_num_blocks, "actor"), _unilab_names(cfg.critic_num_blocks, "critic")
    state = learner.state_dict()
    actor = _network_from_unilab(unilab_sd["actor"], learner.actor.layout, learner.actor.stats_layout, a_names, device)
    state["actor"].update(actor)
    if "zeta_cdf" in unilab_sd["actor"]:
        state["actor"]["zeta_cdf"] = unilab_sd["actor"]["zeta_cdf"]
    for key in ("critic", "target_critic"):
        state[key].update(_network_from_unilab(unilab_sd[key], learner.critic.layout, learner.critic.stats_layout, c_names, device))
    state["temperature"] = {"log_temp": unilab_sd["temperature"]["log_temp"]}
    for key, layout, names in (
        ("actor", learner.actor.layout, a_names[0]),
        ("critic", learner.critic.layout, c_names[0]),
        ("temperature", _TemperatureLayout(), [("log_temp", "log_temp")]),
    ):
        adam = _adam_from_unilab(unilab_sd[f"{key}_optimizer"], layout, names, device)
        adam["schedule_step"] = torch.tensor([float(unilab_sd[f"{key}_scheduler"]["last_epoch"])], device=device, dtype=torch.float64)
        state["optim"][key] = adam
    rn = unilab_sd.get("reward_normalizer")
    if rn is not None and learner.reward_normalizer is not None:
        state["reward_normalizer"] = {
            "mean": rn["rms"]["mean"],
            "var": rn["rms"]["var"],
            "count": rn["rms"]["count"],
            "returns": rn["g_r"],
            "abs_max": rn["g_r_max"],
        }
    state["format"] = STATE_FORMAT
    learner.load_state_dict(state)
    learner.unilab_update_count = int(unilab_sd.get("update_count", 0))

