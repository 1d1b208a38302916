"""Precompiled fused steps (precompiled.py): saved after the first compile, loaded by the next
learner bit-identically; a file the guards refuse, a corrupt file, files for every network."""

import warnings

import pytest
import torch

from flashsac_opt import compile_cache, precompiled
from flashsac_opt.config import FlashSACConfig
from flashsac_opt.learner import FlashSACLearner
from flashsac_opt.testing.oracle import synthetic_batch

DIMS = {"obs_dim": 6, "critic_obs_dim": 7, "action_dim": 3}
# Inductor (aot_compile saves Inductor's output), compile mode: on the CPU it has no CUDA graphs
TINY = dict(batch_size=8, updates_per_step=2, actor_hidden_dim=8, critic_hidden_dim=8, num_atoms=5,
            actor_num_blocks=1, critic_num_blocks=1, learner_mode="compile", compile_backend="inductor")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "cache"  # never the user's ~/.cache
    monkeypatch.setenv(compile_cache.ENV_DIR, str(directory))
    torch._dynamo.reset()
    yield directory
    torch._dynamo.reset()


def close(a, b):  # compiled against eager: a few ulps apart
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


class Owner:
    """A step's owner as the engine sees one: a bound method over live state and constants."""

    def __init__(self):
        self.w = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))

    def step(self, batch, noise, polyak):
        y = batch["x"] @ self.w + noise
        return y.sin() if polyak else y.cos()


def toy(where, owner=None):
    owner = owner or Owner()
    return precompiled.PrecompiledStep(owner.step, "critic", where, lambda: torch.compile(owner.step, fullgraph=True, dynamic=False),
                                       {"backend": "inductor"}), owner


def test_a_step_is_saved_per_constant_and_loaded_by_the_next_owner(tmp_path):
    batch, noise = {"x": torch.randn(3, 4)}, torch.randn(3, 4)
    step, owner = toy(tmp_path)
    with torch.no_grad():
        first = [step(batch, noise, True), step(batch, noise, False)]
    assert step.saved == ["critic-True", "critic-False"] and step.loaded == [] and step.fell_back == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["critic-False.bin", "critic-True.bin"]  # no temporary left
    assert close(first[0], (batch["x"] @ owner.w + noise).sin()) and close(first[1], (batch["x"] @ owner.w + noise).cos())
    torch._dynamo.reset()
    again, other = toy(tmp_path)
    other.w.mul_(2)  # live state: the loaded function reads its owner's tensors at each call
    with torch.no_grad():
        out = again(batch, noise, True)
    assert again.loaded == ["critic-True"] and again.saved == []
    assert close(out, (batch["x"] @ other.w + noise).sin())
    assert precompiled.ready(tmp_path, ["critic"]) and not precompiled.ready(tmp_path, ["critic", "actor"])


def test_steps_are_saved_and_loaded_where_dynamos_aot_switch_is_off_by_default(tmp_path):
    """torch 2.11 ships enable_aot_compile off, and its torch.compile(fn) then has no
    aot_compile: every step fell back to torch.compile on the GPU machine. Off here too, the
    step must still be saved and loaded, and leave the switch as it found it."""
    if not hasattr(torch._dynamo.config, "enable_aot_compile"):
        pytest.skip("this torch has no AOT-compile switch")
    batch, noise = {"x": torch.randn(3, 4)}, torch.randn(3, 4)
    with torch._dynamo.config.patch(enable_aot_compile=False):
        assert not hasattr(torch.compile(Owner().step), "aot_compile")  # what torch 2.11 gives by default
        step, _ = toy(tmp_path)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback warns
            step(batch, noise, True)
        torch._dynamo.reset()
        again, owner = toy(tmp_path)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")
            out = again(batch, noise, True)
        assert torch._dynamo.config.enable_aot_compile is False
    assert (step.saved, step.fell_back, again.loaded, again.fell_back) == (["critic-True"], [], ["critic-True"], [])
    assert close(out, (batch["x"] @ owner.w + noise).sin())


def test_a_call_the_loaded_guards_refuse_falls_back_to_torch_compile_and_a_corrupt_file_is_rewritten(tmp_path):
    batch, noise = {"x": torch.randn(3, 4)}, torch.randn(3, 4)
    step, _ = toy(tmp_path)
    with torch.no_grad():
        step(batch, noise, True)
    torch._dynamo.reset()
    again, owner = toy(tmp_path)
    wider = {"x": torch.randn(5, 4)}, torch.randn(5, 4)  # another shape: the saved guards say no
    with torch.no_grad(), pytest.warns(UserWarning, match="guards refused the call"):
        out = again(*wider, True)
    assert again.fell_back == ["critic-True"] and close(out, (wider[0]["x"] @ owner.w + wider[1]).sin())
    (tmp_path / "critic-True.bin").write_bytes(b"not a compiled function")
    torch._dynamo.reset()
    third, owner = toy(tmp_path)
    with torch.no_grad(), pytest.warns(UserWarning, match="could not be loaded"):
        out = third(batch, noise, True)
    assert third.saved == ["critic-True"] and close(out, (batch["x"] @ owner.w + noise).sin())
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rewritten: the next one loads it without a word
        fourth, _ = toy(tmp_path)
        with torch.no_grad():
            fourth(batch, noise, True)
    assert fourth.loaded == ["critic-True"]
    with pytest.raises(TypeError, match="bound method"):
        precompiled.PrecompiledStep(Owner.step, "critic", tmp_path, lambda: None, {})


def test_a_file_compiled_before_the_steps_source_changed_is_compiled_again(tmp_path, monkeypatch):
    """Guards do not look at source: the file's record of the traced lines does. A step whose
    code was edited after its file was saved must not run the old code."""
    import importlib

    body = """import torch\nclass Owner:\n    def __init__(self):\n        self.w = torch.ones(4, 4)\n    def step(self, batch, noise, polyak):\n        return (batch["x"] @ self.w + noise) * {}\n"""
    (tmp_path / "edited_owner.py").write_text(body.format(2))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("edited_owner")
    batch, noise, where = {"x": torch.ones(2, 4)}, torch.zeros(2, 4), tmp_path / "steps"

    def run():
        owner = module.Owner()
        step = precompiled.PrecompiledStep(owner.step, "critic", where, lambda: torch.compile(owner.step), {"backend": "inductor"})
        with torch.no_grad():
            return step(batch, noise, True)[0, 0].item(), step

    assert run()[0] == 8.0
    torch._dynamo.reset()
    (tmp_path / "edited_owner.py").write_text(body.format(3))
    module = importlib.reload(module)
    with pytest.warns(UserWarning, match="compiled from other source"):
        value, step = run()
    assert value == 12.0 and step.stale == ["critic-True"] and step.saved == ["critic-True"]
    torch._dynamo.reset()
    value, step = run()
    assert value == 12.0 and step.loaded == ["critic-True"]  # the rewritten file matches the source


def make(**overrides):
    torch.manual_seed(0)
    return FlashSACLearner(FlashSACConfig(**{**TINY, **overrides}), device="cpu", **DIMS)


def train(learner, iterations=2):
    cfg = learner.cfg
    for i in range(iterations):
        learner.update(synthetic_batch(cfg.batch_size * cfg.updates_per_step, generator=torch.Generator().manual_seed(i), **DIMS))
    return [t.detach().clone() for t in learner._state_tensors()]


def test_the_learner_saves_its_fused_steps_and_the_next_one_loads_them_bit_identically(cache_dir):
    """The real fused critic and actor steps: the first learner aot-compiles and saves both,
    a second one loads them (no compile) and its whole state after two iterations is the
    first one's, which is what the eager learner computes too, within float rounding."""
    first = make(precompiled_steps=True)
    assert first.load_compile_cache() is None  # nothing saved yet: a compile-ahead child is of use
    state = train(first)
    assert first.fused_update and first.engine.precompiled_report() == {"loaded": [], "saved": ["actor", "critic-True"], "fell_back": [], "stale": []}
    where = first.engine.precompiled_folder(first.cfg.batch_size)
    assert where.parent == cache_dir and sorted(p.name for p in where.iterdir()) == ["actor.bin", "critic-True.bin"]
    torch._dynamo.reset()
    second = make(precompiled_steps=True)
    assert second.load_compile_cache() == str(where)  # every network's step there: no child needed
    again = train(second)
    assert second.engine.precompiled_report() == {"loaded": ["actor", "critic-True"], "saved": [], "fell_back": [], "stale": []}
    assert all(torch.equal(a, b) for a, b in zip(state, again))
    eager = make(learner_mode="eager")  # the same mathematics (torch.compile's learner equals it bit for bit on
    # the CPU, results/startup/aot_precompile_cpu_2026-12-05; a second compile here would double the test)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(state, train(eager)))
    # the split form and the eager learner have no fused step to keep
    assert make(precompiled_steps=True, fused_update=False).load_compile_cache() is None
    assert eager.engine.precompiled_report() is None


def test_another_process_with_the_same_configuration_names_the_same_folder(cache_dir):
    """The compile-ahead children save where the training process looks: the folder's key is a
    digest of the configuration, dims, rows, Inductor options and versions, not of the process."""
    import dataclasses
    import json
    import subprocess
    import sys

    learner = make(precompiled_steps=True)
    script = ("import json, sys; from flashsac_opt.config import FlashSACConfig; from flashsac_opt.learner import FlashSACLearner;"
              "cfg = FlashSACConfig(**json.loads(sys.argv[1])); "
              "print(FlashSACLearner(cfg, 6, 7, 3, device='cpu').engine.precompiled_folder(cfg.batch_size))")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(dataclasses.asdict(learner.cfg))], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == str(learner.engine.precompiled_folder(learner.cfg.batch_size))
    assert learner.engine.precompiled_folder(16) != learner.engine.precompiled_folder(8)


def test_unilab_runs_keep_precompiled_steps_on_cuda_unless_told_otherwise(monkeypatch):
    from flashsac_opt.unilab.adapter import PRECOMPILED_STEPS_ENV, unilab_precompiled_steps

    monkeypatch.delenv(PRECOMPILED_STEPS_ENV, raising=False)
    # unset: on where the protocol measured them (CUDA), off on the CPU
    assert unilab_precompiled_steps(None, "cuda") is True and unilab_precompiled_steps(None, "cuda:1") is True
    assert unilab_precompiled_steps(None, "cpu") is False and unilab_precompiled_steps(True, "cpu") is True
    monkeypatch.setenv(PRECOMPILED_STEPS_ENV, "0")
    assert unilab_precompiled_steps(None, "cuda") is False and unilab_precompiled_steps("on", "cuda") is True  # the config wins
    monkeypatch.setenv(PRECOMPILED_STEPS_ENV, "1")
    assert unilab_precompiled_steps(None, "cpu") is True and unilab_precompiled_steps("off", "cpu") is False
    monkeypatch.setenv(PRECOMPILED_STEPS_ENV, "maybe")
    with pytest.raises(ValueError, match=PRECOMPILED_STEPS_ENV):
        unilab_precompiled_steps(None, "cuda")
