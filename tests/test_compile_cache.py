"""The compile cache file: its key, its default location, a corrupt file, and `flashsac-opt precompile`."""

import json
import warnings

import pytest
import torch

from flashsac_opt import cli, compile_cache
from flashsac_opt.config import FlashSACConfig
from flashsac_opt.learner import FlashSACLearner
from flashsac_opt.testing.oracle import synthetic_batch

DIMS = {"obs_dim": 6, "critic_obs_dim": 7, "action_dim": 3}
TINY = dict(batch_size=8, updates_per_step=2, actor_hidden_dim=8, critic_hidden_dim=8, num_atoms=5,
            actor_num_blocks=1, critic_num_blocks=1, learner_mode="compile", compile_backend="aot_eager")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    # Never the user's ~/.cache; and no artifacts of another test's compilations.
    directory = tmp_path / "cache"
    monkeypatch.setenv(compile_cache.ENV_DIR, str(directory))
    torch._dynamo.reset()
    torch.compiler._cache.CacheArtifactManager.clear()
    yield directory
    torch._dynamo.reset()


def make(dims=DIMS, **overrides):
    torch.manual_seed(0)
    return FlashSACLearner(FlashSACConfig(**{**TINY, **overrides}), device="cpu", **dims)


def batch(learner, seed=0):
    cfg = learner.cfg
    dims = {"obs_dim": learner.obs_dim, "critic_obs_dim": learner.critic_obs_dim, "action_dim": learner.action_dim}
    return synthetic_batch(cfg.batch_size * cfg.updates_per_step, generator=torch.Generator().manual_seed(seed), **dims)


def key(learner, rows=None):
    return learner.engine.compile_cache_key(rows or learner.cfg.batch_size, learner._schedule(None, None))


def test_the_key_changes_with_what_decides_the_code_and_not_with_the_cache_location(monkeypatch):
    base = key(make())
    assert len(base) == 32 and int(base, 16) >= 0
    assert key(make()) == base  # stable across learners (and processes: a digest of JSON)
    changed = {
        "dims": key(make(dims={**DIMS, "obs_dim": 5})),
        "rows": key(make(), rows=16),
        "hidden dim": key(make(critic_hidden_dim=16)),
        "learner_mode": key(make(learner_mode="eager")),
        "inductor_options": key(make(inductor_options={"aggressive_fusion": True})),
        "backend": key(make(compile_backend="inductor")),
        "gamma": key(make(gamma=0.9)),
        "fused_update": key(make(fused_update=False)),
    }
    assert all(k != base for k in changed.values()), [name for name, k in changed.items() if k == base]
    assert len(set(changed.values())) == len(changed)
    # The cache location and fields that never reach the learner's graphs leave it alone.
    assert key(make(compile_cache_file="/elsewhere/cache.bin")) == base
    assert key(make(num_envs=4096, replay_buffer_n=256, max_iterations=7)) == base
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    assert key(make()) != base
    monkeypatch.undo()
    # The GPU kind comes from the device (CPU here), so vary the environment directly.
    env = compile_cache.environment(torch.device("cpu"))
    assert env["gpu"] == "cpu"
    args = dict(rows=8, dims={"obs": 6}, config={"learner_mode": "compile"})
    h200 = compile_cache.cache_key({**env, "gpu": "NVIDIA H200"}, **args)
    assert h200 != compile_cache.cache_key({**env, "gpu": "NVIDIA H100 80GB HBM3"}, **args)
    assert h200 != compile_cache.cache_key({**env, "gpu": "NVIDIA H200", "triton": "0.0"}, **args)


def test_the_default_directory_honours_the_environment_variable(cache_dir, monkeypatch, tmp_path):
    assert compile_cache.default_file("abc") == cache_dir / "abc.bin"
    monkeypatch.delenv(compile_cache.ENV_DIR)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_file("abc") == tmp_path / "home" / ".cache" / "flashsac_opt" / "abc.bin"


def test_auto_loads_the_keyed_file_before_the_first_compile_and_does_not_rewrite_it(cache_dir, monkeypatch):
    learner = make(compile_cache_file="auto")
    assert learner.engine.compile_cache_file is None  # resolved by the first batch
    path = compile_cache.default_file(key(learner))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"artifacts")
    graphs_at_load = []

    def load(data):
        graphs_at_load.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        assert data == b"artifacts"
        return object()

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: pytest.fail("a loaded file is not rewritten"))
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # earlier tests' compiles count too
    learner.update(batch(learner))
    assert graphs_at_load == [before] and torch._dynamo.utils.counters["stats"]["unique_graphs"] > before
    assert learner.engine.compile_cache_file == str(path) and learner.compile_cache_loaded
    assert path.read_bytes() == b"artifacts"


def test_a_corrupt_keyed_file_warns_once_training_continues_and_it_is_rewritten(cache_dir, monkeypatch):
    learner = make(compile_cache_file="auto")
    path = compile_cache.default_file(key(learner))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an artifact file")
    saves = []

    def save():
        saves.append(1)
        return b"fresh artifacts", None

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", save)
    before = learner.critic.params.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        learner.update(batch(learner, 0))
        learner.update(batch(learner, 1))
    messages = [str(w.message) for w in caught if "compile cache" in str(w.message)]
    assert len(messages) == 1 and "could not be loaded" in messages[0] and str(path) in messages[0]
    assert not learner.compile_cache_loaded and learner.engine.compile_cache_saved
    assert torch.isfinite(learner.critic.params).all() and not torch.equal(learner.critic.params, before)
    assert saves == [1] and path.read_bytes() == b"fresh artifacts"  # once, after the first iteration
    assert not list(path.parent.glob("*.tmp"))


def test_the_keyed_file_loads_at_construction_when_asked_and_only_a_loaded_one_counts(cache_dir, monkeypatch):
    # the compile-ahead decision asks this: with a loaded file a training needs no child
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: object() if data == b"artifacts" else None)
    absent = make(compile_cache_file="auto")
    assert absent.load_compile_cache() is None and absent.engine.compile_cache_file is None  # resolved later, as before
    path = compile_cache.default_file(key(absent))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"artifacts")
    warm = make(compile_cache_file="auto")
    assert warm.load_compile_cache() == str(path) and warm.compile_cache_loaded
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    warm.update(batch(warm))  # the first compile keeps the file it found (no second load, no rewrite)
    assert warm.engine.compile_cache_file == str(path) and torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
    path.write_bytes(b"rejected")
    with pytest.warns(UserWarning, match="could not be loaded"):
        assert make(compile_cache_file="auto").load_compile_cache() is None
    assert make(compile_cache_file=None).load_compile_cache() is None  # off: no file at all
    path.write_bytes(b"artifacts")
    ranked = make(compile_cache_file="auto")
    assert ranked.load_compile_cache() == str(path)
    ranked.engine.forget_compile_cache()  # a data-parallel run keys its own file at its first compile
    assert ranked.engine.compile_cache_file is None and not ranked.compile_cache_loaded


def test_a_loaded_cache_file_replaces_the_compile_ahead_child(monkeypatch):
    from flashsac_opt import compile_ahead

    started = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the decision only: nothing runs on a GPU
    monkeypatch.setattr(compile_ahead.CompileAhead, "__init__", lambda self, cfg, dims, device, shares=None: started.append((cfg, shares)))
    cfg, cuda = FlashSACConfig(**TINY), torch.device("cuda")
    monkeypatch.setenv(compile_ahead.ENV_SWITCH, "background")
    monkeypatch.delenv(compile_ahead.SPLIT_ENV, raising=False)
    warm = compile_ahead.CompileAhead.start_if_useful(cfg, DIMS, cuda, compiled=True, warm_cache=lambda: "/c/key.bin")
    assert isinstance(warm, compile_ahead.WarmCache) and warm.done and warm.in_this_process and not started
    assert warm.wait() and warm.report == {"seconds": 0.0, "compile_cache_file": "/c/key.bin", "child": False}
    cold = compile_ahead.CompileAhead.start_if_useful(cfg, DIMS, cuda, compiled=True, warm_cache=lambda: None)
    assert type(cold) is compile_ahead.CompileAhead and not cold.in_this_process and started == [(cfg, compile_ahead.SPLIT_SHARES)]  # one child per network
    monkeypatch.setenv(compile_ahead.ENV_SWITCH, "wait")  # the first update waits for a child: as before
    assert type(compile_ahead.CompileAhead.start_if_useful(cfg, DIMS, cuda, compiled=True, warm_cache=lambda: "/c/key.bin")) is compile_ahead.CompileAhead
    assert compile_ahead.CompileAhead.start_if_useful(cfg, DIMS, torch.device("cpu"), compiled=True, warm_cache=lambda: "x") is None


PRECOMPILE = ["+algo.algo_params.learner_mode=compile", "+algo.algo_params.compile_backend=aot_eager",
              "algo.batch_size=8", "algo.updates_per_step=1", "algo.actor_hidden_dim=8", "algo.critic_hidden_dim=8",
              "algo.num_atoms=5", "algo.algo_params.actor_num_blocks=1", "algo.algo_params.critic_num_blocks=1",
              "--obs-dim", "6", "--critic-obs-dim", "7", "--action-dim", "3", "--device", "cpu"]


def test_precompile_reports_honestly_when_torch_leaves_no_artifacts(cache_dir, capsys):
    assert cli.main(["precompile", *PRECOMPILE]) == 1
    out = capsys.readouterr().out
    assert out.startswith("no cache file written") and "aot_eager" in out and "wrote" not in out
    assert not cache_dir.exists() or not any(cache_dir.iterdir())


def test_precompile_writes_the_file_a_train_with_the_same_overrides_loads(cache_dir, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    torch._dynamo.reset()
    assert cli.main(["precompile", *PRECOMPILE, "--report", str(tmp_path / "precompile.json")]) == 0
    out = capsys.readouterr().out
    files = list(cache_dir.iterdir())
    # --report: the same run as JSON, with where torch's compile timers say the time went
    report = json.loads((tmp_path / "precompile.json").read_text())
    assert report["compile_cache_file"] == str(files[0]) and report["compile_cache_saved"] and report["config"]["batch_size"] == 8
    phases = report["compile_phases_s"]
    assert 0 < phases["dynamo_bytecode_tracing"] <= phases["dynamo_total"] <= report["seconds_total"]
    assert phases["inductor_compile_fx_inner"] == 0.0  # aot_eager: Inductor never ran
    assert report["environment"]["torch"] == torch.__version__ and report["command"].startswith("flashsac-opt")
    assert len(files) == 1 and out.startswith(f"wrote {files[0]} (9 bytes;") and out.rstrip().endswith(" s")
    # A train-side learner with the composed values (the G1 task sets tau 0.05) resolves the same file.
    torch._dynamo.reset()
    learner = make(dims=DIMS, batch_size=8, updates_per_step=1, tau=0.05, compile_cache_file="auto")
    assert compile_cache.default_file(key(learner)) == files[0]


def test_precompile_refuses_eager_and_an_unknown_key(capsys):
    assert cli.main(["precompile", "+algo.algo_params.learner_mode=eager", "--device", "cpu"]) == 2
    assert "compiles nothing" in capsys.readouterr().err
    assert cli.main(["precompile", "algo.no_such_key=1", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.startswith("refused:")
    # off is train's "no file" (adapter.unilab_compile_cache_file): nothing to write, said so
    assert cli.main(["precompile", "+algo.algo_params.compile_cache_file=off", "--device", "cpu"]) == 2
    assert "compile_cache_file is off" in capsys.readouterr().err
