"""Real G1 trainings: stock UniLab 1.5.2 against UniLab patched with flashsac_opt, then stock
UniLab's `eval` on the last flashsac_opt run's checkpoint (stock UniLab plays our checkpoints).

    python3 experiments/device/trainings.py --updates 2 --batch 256 --iterations 1000 --time-limit 580 \\
        --out DIR --work DIR unilab:graph flashsac_opt:graph

RUN = [UN:]LEARNER:MODE[:SEED] (LEARNER unilab|flashsac_opt, MODE eager|compile|graph; UN, e.g.
U8, overrides --updates). Stock and patched UniLab are copies of the installed unilab package
under WORK/../unilab/ with placeholder G1 meshes, the patched one with `flashsac-opt unilab apply`.
Each training's --time-limit is its expected start-up plus an equal share of the time left, so a
slow run is cut, not lost (its JSON says how far it got). JSON to --out, logs to WORK/raw/.
--throwaway: the first RUN only warms the OS file cache (its JSON stays under WORK). A run's name
spells out envs other than 256 (training_u8_b2048_e4096_...), a replay other than seed 001's 32
(..._r512_...) and --name-tag TAG (..._r512_cpu_carrier_...), so it never takes another's name.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))  # common, when run as a script
from common import compile_bytecode  # noqa: E402
TRAIN = REPO / "experiments" / "benchmark_flashsac_training.py"
RUN = re.compile(r"^(?:U(?P<u>[1-9][0-9]*):)?(?P<learner>unilab|flashsac_opt):(?P<mode>eager|compile|graph)(?::(?P<seed>[0-9]+))?$")
# Launch to first update on the H200 (UniLab start ~45 s, compile, capture), cold or with an
# Inductor cache an earlier run of this call filled; other modes ~50 s.
STARTUP_S = {
    # stock graph: cold 187-238 s on one H200 (its max-autotune compile; one U8 seed took more than
    # 236 s), warm 50-83 s (the one-GPU calls of 2026-12-01/02, results/time_to_reward/*_one_gpu_*);
    # a warm estimate above that took the cold seed's share
    ("unilab", "graph", False): 250, ("unilab", "graph", True): 85,
    ("unilab", "compile", False): 130, ("unilab", "compile", True): 70,
    ("flashsac_opt", "compile", False): 130, ("flashsac_opt", "compile", True): 70,
    # flashsac_opt graph: 150-157 s cold when UniLab's thread budget left Inductor one compile
    # worker; the start-up compile now uses the host's CPUs
    ("flashsac_opt", "graph", False): 100, ("flashsac_opt", "graph", True): 45,
}
EVAL_S = 60  # stock eval at the end
SHUTDOWN_S = 20  # per training, after its time limit
MIN_SHARE_S = 30


def parse_runs(texts: list[str], updates: int, startup_s: tuple[int, int] | None = None) -> list[dict]:
    runs = []
    for text in texts:
        m = RUN.match(text)
        if not m:
            raise SystemExit(f"trainings: {text!r} is not [UN:]LEARNER:MODE[:SEED]")
        runs.append(dict(u=int(m["u"] or updates), learner=m["learner"], mode=m["mode"], seed=int(m["seed"] or 1)))
    seen = set()
    for r in runs:
        key = (r["learner"], r["mode"])
        warm = key in seen
        r["startup"] = startup_s[warm] if startup_s else STARTUP_S.get((*key, warm), 50)
        seen.add(key)
    return runs


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "flashsac_opt.cli", *args]


# UniLab's replay pipeline JIT-builds a C++ extension on a CUDA host (20-25 s); a user's install builds
# it once, so it is built for each copy before any measured training (2026-12-01: a cold start carried it).
NATIVE_EXTENSION = ("import sys; from unilab.rl.runtime.ipc.replay_pipelines.native_h2d import _try_load_extension; "
                    "sys.exit(0 if _try_load_extension() is not None else 3)")


def copy_env(env: dict[str, str], site: Path) -> dict[str, str]:
    """The environment of a process that runs the UniLab copy at ``site``: its own folder of torch's
    JIT extensions (one shared folder rebuilt UniLab's at each switch of copy: 21 s in a timed start)."""
    return {**env, "TORCH_EXTENSIONS_DIR": str(site / "torch_extensions")}


def prebuild_native_extension(site: Path) -> tuple[str, float]:
    """Build (or load) UniLab's native H2D extension from the copy at ``site``: ("built", seconds),
    or ("unavailable", seconds) where UniLab finds no CUDA toolkit or compiler (it then uses its
    pure-PyTorch copy, as in the trainings)."""
    env = copy_env(dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])), site)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", NATIVE_EXTENSION], env=env, cwd=site)
    if done.returncode not in (0, 3):
        raise SystemExit(f"trainings: building UniLab's native H2D extension in {site} failed (exit status {done.returncode})")
    return ("built" if done.returncode == 0 else "unavailable"), time.monotonic() - start


def series_digest() -> str:
    """The patch series as this checkout has it: a copy made under another series (a warm
    device machine keeps .device_work/ between calls) is made again."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((REPO / "patches").glob("*.patch")) + [REPO / "patches" / "series.json"]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def copy_installed_unilab(site: Path) -> None:
    """The installed unilab package and its dist-info into ``site`` (replacing what was there),
    with placeholder G1 meshes."""
    spec = importlib.util.find_spec("unilab")
    if spec is None or spec.origin is None:
        raise SystemExit("unilab is not importable (the training wheels: run.py --fetch-wheels training)")
    deps = Path(spec.origin).parent.parent
    if site.exists():
        shutil.rmtree(site)
    shutil.copytree(deps / "unilab", site / "unilab", ignore=shutil.ignore_patterns("__pycache__"))
    for info in deps.glob("unilab-*.dist-info"):
        shutil.copytree(info, site / info.name)
    subprocess.run(cli("unilab", "placeholder-meshes", "--root", str(site / "unilab")), check=True)


def prepare_copies(root: Path, names: tuple[str, ...]) -> tuple[Path, Path]:
    """Stock and patched copies of the installed unilab package, with placeholder meshes; only
    the ``names`` a call's trainings run (each copy costs ~35 s on a fresh machine, its H2D
    extension 21-23 s of it: 2026-12-02)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another trainings.py on this machine may be making them too
        for name in names:
            site = root / name
            ready = site / ".ready"
            if ready.is_file() and ready.read_text() == series_digest():
                continue
            copy_installed_unilab(site)
            if name == "patched":
                subprocess.run(cli("unilab", "apply", "--root", str(site / "unilab")), check=True)
            state, seconds = prebuild_native_extension(site)
            print(f"UniLab's native H2D extension for the {name} copy: {state} in {seconds:.1f} s (before any timed training)", flush=True)
            print(f"its bytecode, as pip writes it at install: {compile_bytecode(site):.1f} s", flush=True)
            ready.write_text(series_digest())
    return root / "stock", root / "patched"


def training_command(r: dict, args, root: Path, share: int, log_root: Path, output: Path) -> list[str]:
    return [sys.executable, str(TRAIN), "--unilab-root", str(root / "unilab"), "--learner", r["learner"], "--mode", r["mode"],
            "--seed", str(r["seed"]), "--num-envs", str(args.envs), "--batch-size", str(args.batch), "--updates-per-step", str(r["u"]),
            "--policy-frequency", "2", "--iterations", str(args.iterations), "--summary-last", str(args.iterations // 2),
            "--learning-starts", str(args.learning_starts), "--replay-buffer-n", str(args.replay_buffer_n),
            "--save-interval", str(min(args.iterations, 100)),
            "--time-limit", str(share), "--log-root", str(log_root), "--output", str(output),
            *(["--stop-at-reward", f"{args.stop_at_reward:g}"] if args.stop_at_reward is not None else []),
            *(["--stack-samples", f"{args.stack_samples:g}"] if args.stack_samples else []),
            *(f"--override={o}" for o in args.override)]


def run_tag(updates: int, batch: int, envs: int, replay_buffer_n: int, name_tag: str | None = None) -> str:
    """The configuration part of a training's name (training_<tag>_<learner>_<mode>_s<seed>): envs
    other than 256, a replay other than seed 001's 32 and a name tag are spelled out."""
    return (f"u{updates}_b{batch}" + (f"_e{envs}" if envs != 256 else "")
            + (f"_r{replay_buffer_n}" if replay_buffer_n != 32 else "") + (f"_{name_tag}" if name_tag else ""))


def _name_tag(text: str) -> str:
    if not re.fullmatch(r"[a-z0-9]+(?:_[a-z0-9]+)*", text):
        raise argparse.ArgumentTypeError(f"a name tag is lower-case letters and digits joined by '_', got {text!r}")
    return text


def _cold_warm(text: str) -> tuple[int, int]:
    try:
        cold, warm = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected COLD,WARM seconds, got {text!r}") from None
    if cold <= 0 or warm <= 0:
        raise argparse.ArgumentTypeError(f"start-up seconds must be > 0, got {text!r}")
    return cold, warm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN")
    parser.add_argument("--updates", type=int, required=True, help="updates per step (a run's UN: prefix overrides it)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--envs", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=1000)
    # seed 001's timing setup (a small replay); UniLab's own defaults are 512 and 98
    parser.add_argument("--replay-buffer-n", type=int, default=32, help="UniLab's algo.replay_buffer_n (default 32: seed 001's timing runs)")
    parser.add_argument("--learning-starts", type=int, default=8, help="UniLab's algo.learning_starts (default 8)")
    parser.add_argument("--time-limit", type=float, default=580.0, help="seconds for all trainings and the eval")
    parser.add_argument("--out", type=Path, required=True, help="the trainings' JSON")
    parser.add_argument("--work", type=Path, required=True, help="logs (WORK/raw/), UniLab runs; the UniLab copies go beside it")
    parser.add_argument("--name-tag", type=_name_tag, metavar="TAG",
                        help="added to every run's name (training_u64_b256_r512_TAG_...), for a configuration its name does not say (an override)")
    parser.add_argument("--stack-samples", type=float, metavar="SECONDS",
                        help="each training samples its processes' Python stacks every SECONDS (startup_stacks in its JSON)")
    parser.add_argument("--startup-s", type=_cold_warm, metavar="COLD,WARM",
                        help="expected launch -> first update of this call's runs, cold and warm (default: STARTUP_S), e.g. for "
                             "a configuration that starts slower (UniLab's CPU carrier: 216 s cold)")
    parser.add_argument("--no-eval", action="store_true", help="skip the stock eval of the last flashsac_opt checkpoint")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="extra Hydra override for every training (repeatable)")
    parser.add_argument("--stop-at-reward", type=float, metavar="R", help="stop each training once its 20-iteration mean reward reaches R")
    parser.add_argument("--throwaway", action="store_true", help="the first RUN only warms the host (OS file cache): its JSON stays in WORK")
    parser.add_argument("--dry-run", action="store_true", help="print the commands with their time shares, run nothing")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.time_limit
    runs = parse_runs(args.runs, args.updates, args.startup_s)
    copies = args.work.parent / "unilab"
    stock, patched = copies / "stock", copies / "patched"
    if not args.dry_run:
        ours = any(r["learner"] == "flashsac_opt" for r in runs)
        # the stock copy runs stock trainings and plays the last flashsac_opt checkpoint (stock eval)
        needs_stock = any(r["learner"] != "flashsac_opt" for r in runs) or (ours and not args.no_eval)
        wanted = (("stock",) if needs_stock else ()) + (("patched",) if ours else ())
        stock, patched = prepare_copies(copies, wanted)
        (args.work / "raw").mkdir(parents=True, exist_ok=True)
        args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)  # the training script puts its UniLab copy and the repository first on the path
    last_ours = None
    failed: list[str] = []  # trainings that exited non-zero: the call's exit status says so
    planned = 0.0  # a dry run's clock: the shares of the runs before, as if each used all of it
    for i, r in enumerate(runs):
        n = len(runs) - i
        fixed = sum(x["startup"] for x in runs[i:])
        left = deadline - time.monotonic() - planned
        eval_s = 0 if args.no_eval else EVAL_S
        share = int(r["startup"] + (left - eval_s - SHUTDOWN_S * n - fixed) / n)
        tag = run_tag(r["u"], args.batch, args.envs, args.replay_buffer_n, args.name_tag)
        name = f"training_{tag}_{r['learner']}_{r['mode']}_s{r['seed']}"
        root = patched if r["learner"] == "flashsac_opt" else stock
        logs = args.work / f"logs_{name}"
        # a throw-away first run (it warms the OS file cache) writes its JSON beside its logs
        out = args.work if (args.throwaway and i == 0) else args.out
        cmd = training_command(r, args, root, share, logs, out / f"{name}.json")
        if args.dry_run:
            print(f"[{name}] time limit {share} s (start-up ~{r['startup']} s): {shlex.join(cmd)}")
            planned += share + SHUTDOWN_S
            if r["learner"] == "flashsac_opt":
                last_ours = (logs, tag)
            continue
        if share < MIN_SHARE_S:
            print(f"== {name}: skipped, only {share} s left", flush=True)
            continue
        log = args.work / "raw" / f"{name}.log"
        with log.open("w") as f:
            try:
                rc = subprocess.run(cmd, env=copy_env(env, root), stdout=f, stderr=subprocess.STDOUT, timeout=max(share + 90, 1)).returncode
            except subprocess.TimeoutExpired:
                rc = "killed at its limit + 90 s"
        lines = [line for line in log.read_text(errors="replace").splitlines() if not line.startswith(("│", "╭", "╰", "├", "┃"))]
        keep = 6 if rc == 0 else 150  # a failed run shows its whole traceback (HYDRA_FULL_ERROR)
        if rc != 0:
            failed.append(f"{name} (rc={rc})")
        print(f"== {name}: rc={rc}, limit {share} s, {args.time_limit - (deadline - time.monotonic()):.0f} s into the run", flush=True)
        print("\n".join(lines[-keep:]), flush=True)
        if os.environ.get("TORCH_LOGS"):  # keep what Dynamo and the cudagraph trees said
            said = [line for line in lines if re.search(r"ecompil|e-record|cudagraph|guard", line)][:400]
            (args.work / "raw" / f"{name}.torch_logs.log").write_text("\n".join(said))
        if r["learner"] == "flashsac_opt":
            last_ours = (logs, tag)
    if last_ours and not args.no_eval:
        stock_eval(last_ours, stock, args, deadline, env)
    if failed:
        # e.g. a cold stock start that used its whole share before a first update (rc 2, no JSON)
        print(f"== trainings: {len(failed)} of {len(runs)} failed: {', '.join(failed)}", flush=True)
        return 1
    return 0


def stock_eval(last_ours: tuple[Path, str], stock: Path, args, deadline: float, env: dict) -> None:
    """Stock UniLab's eval on the flashsac_opt run's last checkpoint (a few steps, video best effort)."""
    logs, tag = last_ours
    runs = sorted(p for p in (logs / "G1WalkFlat").glob("*/") if p.is_dir()) if logs.is_dir() else []
    code = "import sys; from unilab.cli import eval_main; sys.argv = ['eval'] + sys.argv[1:]; sys.exit(eval_main())"
    if args.dry_run:
        print(f"[stock eval] cd {logs} && PYTHONPATH={stock}:... python3 -c {shlex.quote(code)} --algo flashsac --task g1_walk_flat "
              f"--sim mujoco --load-run RUN ...  (the last flashsac_opt run's checkpoint)")
        return
    if not runs:
        print("stock eval skipped: the flashsac_opt run left no run folder", flush=True)
        return
    run = runs[-1]
    if not list(run.glob("model_*.pt")):
        # UniLab's eval exits 0 after "Could not find checkpoint": say it here instead
        print(f"stock eval skipped: the flashsac_opt run {run} wrote no checkpoint", flush=True)
        return
    deps = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    cmd = [sys.executable, "-c", code, "--algo", "flashsac", "--task", "g1_walk_flat", "--sim", "mujoco", "--load-run", run.name,
           "--render-mode", "record", "training.play_steps=20", "training.play_env_num=4", "training.export_onnx=false",
           f"training.log_root={logs}", f"env.scene.model_file={stock / 'unilab/assets/robots/g1/scene_flat.xml'}"]
    log = args.work / "raw" / f"stock_eval_of_flashsac_opt_{tag}.log"
    with log.open("w") as f:
        try:
            # from the log folder: Hydra writes its train_flashsac.log into the working directory
            rc = subprocess.run(cmd, cwd=logs, env=copy_env({**env, "PYTHONPATH": os.pathsep.join([str(stock), *deps])}, stock), stdout=f,
                                stderr=subprocess.STDOUT, timeout=max(deadline - time.monotonic(), 20)).returncode
        except subprocess.TimeoutExpired:
            rc = "killed at the run's limit"
    loaded = next((line for line in log.read_text(errors="replace").splitlines() if "Loading flashsac checkpoint" in line), "")
    print(f"stock eval rc={rc}: {loaded.strip() or 'no checkpoint-loaded line'}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
