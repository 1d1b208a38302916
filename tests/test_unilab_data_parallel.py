"""UniLab's data-parallel contract through the adapter (CPU over gloo; two GPUs over NCCL): two ranks with
UniLab 1.5.2's own process-group object (DpParameterSync) in the order its runner uses it:
``set_gradient_sync`` (runner constructor), ``start`` + ``broadcast_from_rank0(dp_initial_sync())``
(``_dp_init_broadcast``), ``prepare_for_collection``, iterations on rank-local data,
``set_gradient_sync(None)`` and ``close`` at shutdown. The ranks' checkpoints must be equal.

The later tests run the whole thing through UniLab's own `train` with two ranks on the CPU (patch
0003 lets a CPU-only torch run them over gloo; real MuJoCo collectors): rank 0's checkpoint, a rank
that dies, a resume on another world size, and torchrun starting the ranks as on two machines."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

_RANK = r"""
import json, sys, torch
from unilab.rl.runtime.distributed.sync import DpParameterSync
from flashsac_opt.data_parallel import collective_bytes_per_iteration, state_digest
from flashsac_opt.testing.oracle import synthetic_batch
from flashsac_opt.unilab.adapter import build_unilab_learner
from test_unilab_integration import _unilab_kwargs

rank, folder, batch_size, device, wire = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
if device == "cuda":  # one GPU per rank, as UniLab's launcher makes it
    device, backend, mode = f"cuda:{rank}", "nccl", "graph"
else:
    backend, mode = "gloo", "eager"
torch.manual_seed(100 + rank)  # per-rank seeds, as UniLab derives them: different initial networks
learner = build_unilab_learner(device=device, learner_mode=mode,
                               **_unilab_kwargs(actor_hidden_dim=16, critic_hidden_dim=16, batch_size=batch_size, updates_per_step=2))
sync = DpParameterSync(world_size=2, rank=rank, rendezvous_path=f"{folder}/rendezvous", backend=backend, device=device, timeout_s=60,
                       gradient_wire_dtype=wire)
learner.set_gradient_sync(sync.allreduce_gradients)
seeded = state_digest(learner.learner.state_dict())
try:
    sync.start()
    sync.broadcast_from_rank0(learner.dp_initial_sync())
except ValueError as exc:
    print("REFUSED " + str(exc), flush=True)
    sync.close()  # as the runner's shutdown does
    sys.exit(3)
initial = state_digest(learner.learner.state_dict())

class Context:
    target_frequency, policy_before_critic, updates_per_step, policy_frequency = 1, False, 2, 2
    replay_batch = synthetic_batch(2 * batch_size, 98, 101, 29, torch.Generator().manual_seed(7), device=device)

learner.prepare_for_collection(Context())
g = torch.Generator().manual_seed(rank)  # rank-local data
for _ in range(3):
    learner.update_reward_stats(torch.randn(1, 8, generator=g).to(device), torch.zeros(1, 8, device=device))
    learner.update_cycle(synthetic_batch(2 * batch_size, 98, 101, 29, g, device=device), updates_per_step=2, policy_frequency=2,
                         target_frequency=1, policy_before_critic=False)
metrics = learner.read_deferred_cycle_metrics()
torch.save(learner.get_state_dict(), f"{folder}/rank{rank}.pt")
learner.set_gradient_sync(None)
sync.close()
print("RESULT " + json.dumps({"seeded": seeded, "initial": initial, "digest": state_digest(learner.learner.state_dict()),
                             "iterations": learner.learner.iterations, "metrics": metrics,
                             "collective_bytes": collective_bytes_per_iteration(learner.learner, 2, 2)}), flush=True)
"""


def run_ranks(tmp_path: Path, batch_sizes: tuple[int, int], device: str = "cpu", wire: str = "float32") -> list[subprocess.CompletedProcess]:
    tests = Path(__file__).parent  # the ranks import test_unilab_integration's UniLab kwargs
    tmp_path.mkdir(parents=True, exist_ok=True)  # the ranks' rendezvous file and checkpoints
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), str(tmp_path), str(batch_sizes[rank]), device, wire],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in (0, 1)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def result(done: subprocess.CompletedProcess) -> dict:
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert done.returncode == 0 and line, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


def two_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_two_ranks_through_unilabs_process_group_end_with_equal_checkpoints(tmp_path, require_unilab, device):
    """cpu: gloo, eager. cuda: NCCL, graph mode (the all-reduce captured with the iteration)."""
    import torch

    if device == "cuda" and not two_gpus():
        pytest.skip("needs two CUDA devices")
    runs = run_ranks(tmp_path, (32, 32), device)
    r0, r1 = (result(d) for d in runs)
    for rank, (done, r) in enumerate(zip(runs, (r0, r1))):  # what a real run's logs show at shutdown
        assert f"flashsac_opt: rank {rank} state digest {r['digest']}" in done.stdout
    assert r0["seeded"] != r1["seeded"]  # per-rank seeds: different networks before the broadcast
    assert r0["initial"] == r1["initial"]  # rank 0's after it
    assert r0["digest"] == r1["digest"] != r0["initial"]  # trained on different data, still bit-identical
    assert r0["iterations"] == r1["iterations"] == 3
    assert r0["metrics"] == r1["metrics"]  # averaged losses: the same on both ranks
    a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True, map_location="cpu") for r in (0, 1))
    for section in ("actor", "critic", "target_critic"):  # the checkpoints stock UniLab loads
        assert a[section].keys() == b[section].keys()
        for key in a[section]:
            assert torch.equal(a[section][key], b[section][key]), (section, key)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_unilabs_bf16_gradient_wire_is_honoured_and_the_ranks_stay_bit_identical(tmp_path, require_unilab, device):
    """UniLab's training.dp_gradient_wire_dtype=bfloat16 reaches flashsac_opt's averager through the
    sync UniLab hands over: the gradients cross the wire as bf16 (fewer bytes), the result differs
    from the fp32 wire's on the same seeds and data, and both ranks still agree bit for bit
    (cuda: NCCL, graph mode, the bf16 all-reduce captured with the iteration)."""
    if device == "cuda" and not two_gpus():
        pytest.skip("needs two CUDA devices")
    fp32 = [result(d) for d in run_ranks(tmp_path / "fp32", (32, 32), device)]
    bf16 = [result(d) for d in run_ranks(tmp_path / "bf16", (32, 32), device, wire="bfloat16")]
    assert bf16[0]["digest"] == bf16[1]["digest"] and fp32[0]["digest"] == fp32[1]["digest"]
    assert bf16[0]["initial"] == fp32[0]["initial"]  # the same start: the wire alone differs
    assert bf16[0]["digest"] != fp32[0]["digest"]
    assert bf16[0]["collective_bytes"] < fp32[0]["collective_bytes"]


def test_ranks_with_different_batch_sizes_fail_at_start_naming_the_field(tmp_path, require_unilab):
    for done in run_ranks(tmp_path, (32, 64)):
        assert done.returncode == 3, done.stdout[-2000:] + done.stderr[-3000:]
        refused = next(ln for ln in done.stdout.splitlines() if ln.startswith("REFUSED "))
        assert "same learner configuration" in refused and "config.batch_size (rank 0: 32, rank 1: 64)" in refused


def test_a_cuda_run_with_nccls_fast_transports_off_is_told_how_to_turn_them_on():
    """UniLab's DpParameterSync sets NCCL_P2P_DISABLE / NCCL_SHM_DISABLE to 1 unless exported; on
    CUDA the adapter names the variables that are off and the export that turns them on; CPU
    (gloo) and exported values are left alone."""
    from flashsac_opt.unilab.adapter import nccl_transport_notice

    both_off = nccl_transport_notice("cuda", {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"})
    assert "NCCL_P2P_DISABLE and NCCL_SHM_DISABLE=1" in both_off and "export NCCL_P2P_DISABLE=0 NCCL_SHM_DISABLE=0" in both_off
    assert "NCCL_SHM_DISABLE" not in nccl_transport_notice("cuda", {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "0"}).split("=1")[0]
    assert nccl_transport_notice("cuda", {"NCCL_P2P_DISABLE": "0", "NCCL_SHM_DISABLE": "0"}) is None
    assert nccl_transport_notice("cuda", {}) is None
    assert nccl_transport_notice("cpu", {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}) is None


def test_the_data_parallel_hooks_refuse_misuse(require_unilab):
    import torch

    from test_unilab_integration import _unilab_kwargs

    from flashsac_opt.testing.oracle import synthetic_batch
    from flashsac_opt.unilab.adapter import build_unilab_learner

    learner = build_unilab_learner(device="cpu", learner_mode="eager", **_unilab_kwargs(actor_hidden_dim=16, critic_hidden_dim=16))
    with pytest.raises(TypeError, match="a callable"):
        learner.set_gradient_sync("allreduce")
    with pytest.raises(RuntimeError, match="set_gradient_sync"):
        learner.dp_initial_sync()
    learner.update_cycle(synthetic_batch(64, 98, 101, 29, torch.Generator().manual_seed(0)), updates_per_step=2,
                         policy_frequency=2, target_frequency=1, policy_before_critic=False)
    learner.set_gradient_sync(lambda params: None)
    with pytest.raises(ValueError, match="before the first update"):
        learner.dp_initial_sync()  # the update functions exist: too late to become data parallel
    learner.set_gradient_sync(None)  # shutdown: nothing captured to release in eager mode, no error


def launch_two_cpu_ranks(site: Path, tmp_path: Path, iterations: int) -> tuple[list[str], dict, Path]:
    """UniLab's `train` for two ranks on a CPU-only torch: (command, environment, log root)."""
    import torch

    from flashsac_opt.unilab import patch as unilab_patch
    from unilab_tree import add_g1_placeholders, g1_cpu_training

    if torch.backends.cuda.is_built():
        pytest.skip("patch 0003 runs ranks on the CPU only with a CPU-only torch build (CI's)")
    unilab_patch.apply(site, include_optional=True)
    scene = add_g1_placeholders(site / "unilab")
    logs = tmp_path / "logs"
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{Path(__file__).resolve().parents[1]}",
               CUDA_VISIBLE_DEVICES="slot0,slot1", WANDB_MODE="disabled")
    command = g1_cpu_training(scene, logs, "algo.algo_params.compile_cache_file=off",
                              "training.dp_collector_cpu_ids=[[0],[1]]",  # one CPU per rank's collector, whatever the topology
                              iterations=iterations)
    return command, env, logs


def test_unilabs_launcher_resumes_a_one_rank_checkpoint_on_two_cpu_ranks_that_end_with_rank_0s_checkpoint(site, tmp_path, monkeypatch):
    """`train --algo flashsac --task g1_walk_flat --sim mujoco` on a CPU-only torch, first with one
    rank, then resumed from its checkpoint (`algo.resume=true`) with two: UniLab's train infers them
    from CUDA_VISIBLE_DEVICES' two entries (rank slots here, patch 0003), rank 0 spawns rank 1, each
    runs its own MuJoCo collector (seed + rank) and flashsac_opt's learner in UniLab's gloo group.
    Both ranks load the one-rank checkpoint (checkpoints hold no rank-specific state) and go on from
    its iteration count. Only rank 0 writes checkpoints; at shutdown each rank prints the digest of
    its whole learner state and of the networks its checkpoint would hold: all must agree, and with
    the networks of rank 0's last checkpoint file, which stock UniLab's `eval` plays.
    (One test for the launcher and the resume: each 2-rank run costs ~50 s of CI's 2 cores.)"""
    import torch

    from flashsac_opt.data_parallel import state_digest
    from flashsac_opt.unilab.adapter import CHECKPOINT_NETWORKS

    command, env, logs = launch_two_cpu_ranks(site, tmp_path, iterations=3)
    single = subprocess.run(command, env=dict(env, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert single.returncode == 0 and "Training complete" in single.stdout + single.stderr, (single.stdout + single.stderr)[-4000:]
    (first,) = glob.glob(str(logs / "G1WalkFlat" / "*" / "model_3.pt"))
    before = torch.load(first, weights_only=True)["flashsac_opt"]["iterations"]
    assert before > 0  # flashsac_opt's learner did the updates
    resumed = [a.replace("algo.max_iterations=3", "algo.max_iterations=6") for a in command]
    resumed += ["algo.resume=true", f"algo.load_run={Path(first).parent.name}"]  # its last checkpoint
    events = tmp_path / "startup_events.jsonl"  # where the training benchmark reads the ranks' end states
    proc = subprocess.run(resumed, env=dict(env, FLASHSAC_OPT_STARTUP_EVENTS=str(events)), capture_output=True, text=True, timeout=900, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Training complete" in out and "Traceback" not in out, out[-4000:]
    assert out.count(f"Resumed learner state from {first}") == 2  # UniLab's line, once per rank
    lines = dict(re.findall(r"flashsac_opt: rank (\d) (state digest \w+ checkpoint networks digest \w+)", out))
    assert set(lines) == {"0", "1"}, out[-4000:]  # rank 1 ran too, in UniLab's group
    assert lines["0"] == lines["1"]  # bit-identical ranks at the end
    # the same digests, as benchmark_flashsac_training's JSON reports them (its data_parallel field)
    from test_experiments import REPO, load

    monkeypatch.syspath_prepend(str(REPO / "experiments"))  # the script's own imports, as when it runs
    ends = load("benchmark_flashsac_training.py").data_parallel_end(events)
    assert ends["world_size"] == 2 and ends["ranks_equal"] and [r["rank"] for r in ends["ranks"]] == [0, 1]
    assert lines["0"] == f"state digest {ends['ranks'][0]['state_digest']} checkpoint networks digest {ends['ranks'][0]['networks_digest']}"
    (checkpoint,) = glob.glob(str(logs / "G1WalkFlat" / "*gpux2" / "model_6.pt"))
    state = torch.load(checkpoint, weights_only=True)
    assert state["flashsac_opt"]["iterations"] == before + 3  # iterations 4-6
    networks = state_digest({k: state[k] for k in CHECKPOINT_NETWORKS})
    assert lines["0"].endswith(f"checkpoint networks digest {networks}")  # rank 1's networks = rank 0's file
    # stock (unpatched) UniLab's `eval` plays the data-parallel run's checkpoint
    from unilab_tree import stock_eval

    played = stock_eval(tmp_path, Path(checkpoint).parent, env)
    said = played.stdout + played.stderr
    assert played.returncode == 0 and f"Loading flashsac checkpoint: {checkpoint}" in said and "Traceback" not in said, said[-3000:]


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or not ours
        return b""


def test_a_rank_that_dies_takes_the_run_down_promptly_and_leaves_no_process(site, tmp_path):
    """Rank 1 killed (SIGKILL) while training: rank 0, blocked in or heading for the next all-reduce
    in UniLab's gloo group, fails at once ("connection closed by peer"), the run stops (UniLab's
    launcher names the dead rank when it saw it first), and nothing of the run is left
    running. No hang, no interpreter abort at shutdown."""
    import signal
    import time

    if not Path("/proc/self/environ").exists():
        pytest.skip("finds the ranks through /proc")
    command, env, logs = launch_two_cpu_ranks(site, tmp_path, iterations=5000)
    log = tmp_path / "train.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while not glob.glob(str(logs / "G1WalkFlat" / "*" / "model_3.pt")):  # training is under way
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.5)
            # rank 1: the train process that UniLab's launcher started with UNILAB_DP_RANK=1 (its
            # collector inherits that environment too, so pick the one whose parent is not a rank 1)
            ours = [int(p) for p in os.listdir("/proc") if p.isdigit() and str(logs).encode() in _environ(int(p))]
            rank1 = [p for p in ours if b"UNILAB_DP_RANK=1" in _environ(p) and b"train_flashsac" in Path(f"/proc/{p}/cmdline").read_bytes()]
            assert len(rank1) == 1, ours
            os.kill(rank1[0], signal.SIGKILL)
            killed = time.monotonic()
            proc.wait(timeout=120)
            took = time.monotonic() - killed
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert took < 60, out[-4000:]
    # UniLab's launcher names the dead rank when its watchdog polled it before rank 0's all-reduce
    # failed; otherwise rank 0's gloo error is what surfaces first (one CI run of b6b636c: "Read
    # error ...: Connection reset by peer", no launcher line). Either way the run is down at once.
    peer_gone = ("Connection reset by peer" in out or "Connection closed by peer" in out) and "gloo" in out
    assert ("rank 1 exit code -9" in out or peer_gone) and "Fatal Python error" not in out, out[-4000:]
    time.sleep(2)  # the launcher's teardown has returned; its process groups are gone
    left = [p for p in os.listdir("/proc") if p.isdigit() and str(logs).encode() in _environ(int(p))]
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in left]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_starts_the_ranks_as_on_two_machines_and_they_meet_over_tcp(site, tmp_path):
    """Several machines: each runs `torchrun --nnodes 2 --node-rank K --master-addr ...` around UniLab's
    train (patch 0003 turns torchrun's RANK / WORLD_SIZE into UniLab's ranks, skips rank 0's local
    spawning and meets over torchrun's TCP store). Two torchrun processes with their own working
    directories stand in for the two machines; the ranks are CPU ranks over gloo (CPU-only torch)."""
    import torch

    from flashsac_opt.data_parallel import state_digest
    from flashsac_opt.unilab.adapter import CHECKPOINT_NETWORKS

    command, env, logs = launch_two_cpu_ranks(site, tmp_path, iterations=6)
    env.pop("CUDA_VISIBLE_DEVICES")  # a machine's own GPUs; each "machine" here runs one CPU rank
    from unilab_tree import TRAIN_CODE

    entry = tmp_path / "train_entry.py"  # what the `train` console script runs
    entry.write_text(TRAIN_CODE + "\n")
    overrides = [a for a in command[3:] if a != "training.dp_collector_cpu_ids=[[0],[1]]"]
    port = _free_port()
    machines = []
    for node in (0, 1):
        cwd = tmp_path / f"machine{node}"
        cwd.mkdir()
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), str(entry), *overrides]
        machines.append(subprocess.Popen(torchrun, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [m.communicate(timeout=900)[0] for m in machines]
    for m, out in zip(machines, outs):
        # torchrun's agents race on the TCP store in their exit barrier: the store's host may
        # close it while the other agent still waits, which logs a traceback from the agent
        # (elastic/agent/server/api.py) and exits 0 (pytorch/pytorch#69520, open). Every other
        # line, the ranks' and UniLab's, must be free of tracebacks.
        ours = "\n".join(line for line in out.splitlines() if "elastic/agent/server/api.py" not in line)
        assert m.returncode == 0 and "Traceback" not in ours, out[-4000:]
    assert "Training complete" in outs[0]  # rank 0 (machine 0) logs and checkpoints
    lines = dict(re.findall(r"flashsac_opt: rank (\d) (state digest \w+ checkpoint networks digest \w+)", "".join(outs)))
    assert set(lines) == {"0", "1"} and lines["0"] == lines["1"], outs[0][-2000:] + outs[1][-2000:]
    (checkpoint,) = glob.glob(str(logs / "G1WalkFlat" / "*" / "model_6.pt"))
    state = torch.load(checkpoint, weights_only=True)
    assert lines["0"].endswith(f"checkpoint networks digest {state_digest({k: state[k] for k in CHECKPOINT_NETWORKS})}")
