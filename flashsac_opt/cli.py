"""The ``flashsac-opt`` command line."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flashsac_opt.learner import FlashSACLearner


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def info(_args: argparse.Namespace) -> int:
    """Versions, device and whether UniLab's FlashSAC learner is importable."""
    import torch

    from rich.console import Console
    from rich.table import Table

    import flashsac_opt

    table = Table(title="flashsac-opt info", show_header=False)
    table.add_row("flashsac_opt", flashsac_opt.__version__)
    table.add_row("python", platform.python_version())
    table.add_row("torch", torch.__version__)
    table.add_row("triton", _version("triton") or "not installed")
    if torch.cuda.is_available():
        device = f"cuda: {torch.cuda.get_device_name(0)} (x{torch.cuda.device_count()}), CUDA {torch.version.cuda}"
    else:
        device = "cpu (no CUDA device)"
    table.add_row("device", device)
    unilab_version = _version("unilab")
    if unilab_version is None:
        status = "not installed (pip install 'flashsac-opt[unilab]')"
    elif importlib.util.find_spec("unilab.rl.algos.flash_sac") is None:
        status = f"{unilab_version}, but unilab.rl.algos.flash_sac is missing"
    else:
        status = f"{unilab_version}, FlashSAC learner importable"
        if unilab_version != "1.5.2":
            status += " (flashsac_opt targets 1.5.2)"
    table.add_row("unilab", status)
    Console().print(table)
    return 0


WIDTH = 80  # `flashsac-opt unilab` output fits an 80-column terminal


def _wrap(text: str, first: str = "", indent: str = "  ") -> list[str]:
    """``text`` in lines of at most WIDTH characters, the first starting with ``first``, the
    others with ``indent``. A word longer than a line (a long path) is split after a '/'
    where it can be, so each piece still reads as part of the path."""
    lines, line = [], first
    for word in text.split():
        while word:
            sep = "" if line == "" or line.endswith(" ") else " "
            room = WIDTH - len(line) - len(sep)
            if len(word) <= room:
                line += sep + word
                break
            if len(word) > WIDTH - len(indent) and room > 0:  # too long for any line: split it here
                cut = word.rfind("/", 0, room) + 1 or room
                line += sep + word[:cut]
                word = word[cut:]
            lines.append(line)
            line = indent
    lines.append(line)
    return lines


def _status_lines(report: dict) -> list[str]:
    if report["version"] is not None:
        head = f"UniLab {report['version']} ({report['version_source']}) at {report['unilab_dir']}"
    else:
        head = f"UniLab (version unknown: {report['version_source']}) at {report['unilab_dir']}"
    lines = _wrap(head)
    for p in report["patches"]:
        lines.append("")
        lines += _wrap(f"{p['name']}{' (optional)' if p['optional'] else ''}: {p['state']}")
        lines += _wrap(p["description"], first="  ", indent="  ")
        width = max(len(state) for state in p["files"].values())
        for path, state in p["files"].items():
            lines += _wrap(path, first=f"    {state:<{width}}  ", indent=" " * (width + 6))
    return lines


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


PLACEHOLDER_HELP = """\
placeholder-meshes: for running UniLab's G1 tasks offline. UniLab downloads
the G1 robot's STL meshes from a model hub at first use; without a connection
training fails on pelvis.STL. This creates, under unilab/assets/robots/g1/,
one tiny placeholder mesh (a 1-mm tetrahedron) per mesh file that scene_flat.xml
uses (assets/*.STL) and textures/floor.png (UniLab's marker that the G1 assets
are complete). It writes only files that are missing: real meshes, if present,
are never overwritten. Before writing, it compiles every G1 model XML that uses
those meshes with MuJoCo and refuses unless each geom using them is visual only
(contype 0, conaffinity 0, no contact pair, no mass, and a short simulation
identical with tiny and large meshes), so physics is unchanged. Renders and
videos will show no robot body. Delete the created files (or put the real
meshes over them) to undo.
"""


def _placeholder_meshes(args: argparse.Namespace) -> int:
    from flashsac_opt.unilab import assets
    from flashsac_opt.unilab.patch import PatchError

    try:
        report = assets.placeholder_meshes(args.root, dry_run=args.dry_run)
    except assets.AssetWriteError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except (assets.AssetError, PatchError) as exc:
        print(f"refused: {_one_line(exc)}", file=sys.stderr)
        return 2
    lines = _wrap(f"G1 model directory: {report.g1_dir}")
    lines += _wrap(
        f"checked with MuJoCo: {', '.join(report.models)}: all {report.mesh_geoms} geoms using these "
        "meshes are visual only (no collision, no contact pair, no mass; a short simulation is the "
        "same with tiny and large meshes), so physics is unchanged.")
    verb = "would create" if report.dry_run else "created"
    lines += [f"{verb}: {path.relative_to(report.g1_dir)}" for path in report.created]
    if report.kept:
        lines += _wrap(f"kept, never overwritten: {len(report.kept)} existing file(s) that are not "
                       f"placeholders (real meshes), e.g. {report.kept[0].relative_to(report.g1_dir)}")
    if report.already:
        lines.append(f"already there from an earlier run, left as they are: {len(report.already)} file(s)")
    if report.created or report.already:
        lines += _wrap(
            "Renders and videos will show no robot body for the placeholder meshes. To undo, "
            "delete the created files or put the real meshes over them.")
    lines += _wrap(f"G1 scene for env.scene.model_file: {report.scene}")
    print("\n".join(lines))
    return 0


def unilab(args: argparse.Namespace) -> int:
    """status | apply | revert the patch series on a UniLab 1.5.2 tree; placeholder-meshes."""
    from flashsac_opt.unilab import patch as unilab_patch

    if args.action == "placeholder-meshes":
        return _placeholder_meshes(args)
    try:
        if args.action == "status":
            report = unilab_patch.status(args.root)
        elif args.action == "apply":
            changed = unilab_patch.apply(args.root, args.patch, include_optional=args.with_cpu_smoke, dry_run=args.dry_run)
        else:
            changed = unilab_patch.revert(args.root, args.patch, dry_run=args.dry_run)
    except unilab_patch.PatchError as exc:
        print(f"refused: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # a PatchWriteError names the file; another OSError (a read) names its own
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 1
    if args.action == "status":
        print("\n".join(_status_lines(report)))
        return 0
    verb = {"apply": "patched", "revert": "restored"}[args.action]
    prefix = "would be " if args.dry_run else ""
    if not changed:
        print(f"nothing to do: already {'applied' if args.action == 'apply' else 'original'}")
    for path in changed:
        print(f"{prefix}{verb}: {path}")
    return 0


PRECOMPILE_HELP = """\
Composes the UniLab config with Hydra (the same overrides as `train`, e.g.
algo.batch_size=256 algo.updates_per_step=64 algo.algo_params.learner_mode=graph;
a key the config lacks takes Hydra's '+'), builds flashsac_opt's learner for the
given dims, runs one iteration on a synthetic batch (compile, and in graph mode
capture) and writes torch.compile's cache artifacts to
algo.algo_params.compile_cache_file, or with that unset to the keyed default
file (flashsac_opt/compile_cache.py; refused when it is "off"). A later `train`
with the same setting (the keyed default when unset) then loads it before
compiling. The key covers the dims and every config value that reaches the
compiled code: train with the same overrides (patch 0001 hands `train`'s learner
learner_mode, fused_update and compile_cache_file of flashsac_opt's engine options
only: another one set here gives a file `train` will not find). Exit status 1 when
torch left no artifacts to write (e.g. compile_backend=aot_eager), 2 when refused.
On CUDA, as under `train`, the fused steps are also saved whole beside the file
(flashsac_opt/precompiled.py; FLASHSAC_OPT_PRECOMPILED_STEPS=0 leaves them out, =1
adds them on the CPU).
"""


def _unilab_config_file() -> Path:
    import unilab

    return Path(unilab.__file__).parent / "conf" / "flashsac" / "config.yaml"


def precompile(args: argparse.Namespace) -> int:
    """Compile (and capture) once for a configuration and write the compile cache file."""
    import time

    import torch
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from flashsac_opt import compile_ahead
    from flashsac_opt.config import UNILAB_RUN_DEFAULTS, FlashSACConfig
    from flashsac_opt.learner import FlashSACLearner
    from flashsac_opt.unilab.adapter import unilab_compile_cache_file, unilab_precompiled_steps

    start = time.perf_counter()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = Path(args.config) if args.config else _unilab_config_file()
    try:
        with initialize_config_dir(config_dir=str(config.resolve().parent), version_base=None):
            composed = compose(config.stem, overrides=list(args.overrides))
        # What patch 0001 passes where the config has no value (graph mode); the adapter then
        # resolves the cache file (the keyed default unless a path or "off" is configured).
        cfg = FlashSACConfig.from_unilab(composed, defaults=UNILAB_RUN_DEFAULTS)
        # as the adapter resolves them: what a UniLab run of this configuration then loads
        cfg = cfg.replace(compile_cache_file=unilab_compile_cache_file(cfg.compile_cache_file),
                          precompiled_steps=unilab_precompiled_steps(cfg.precompiled_steps, device))
        if cfg.compile_cache_file is None:
            raise ValueError("algo.algo_params.compile_cache_file is off: there is no file to write")
        learner = FlashSACLearner(cfg, args.obs_dim, args.critic_obs_dim, args.action_dim, device=device)
    except (HydraException, OmegaConfBaseException, ValueError, TypeError) as exc:
        print(f"refused: {_one_line(exc)}", file=sys.stderr)
        return 2
    if not learner.engine.compiled:
        print(f"refused: learner_mode={learner.engine.mode} compiles nothing, so there is nothing to cache", file=sys.stderr)
        return 2
    report = compile_ahead.precompile(learner)
    seconds = time.perf_counter() - start
    what = f"learner_mode={learner.engine.mode}, {cfg.batch_size} rows x {cfg.updates_per_step} updates, {report['device']}"
    steps = report["precompiled_steps"]
    if steps:  # FLASHSAC_OPT_PRECOMPILED_STEPS=1: the fused steps' own files, beside the cache file
        print(f"precompiled steps in {learner.engine.precompiled_folder(cfg.batch_size)}: saved {steps['saved']}, "
              f"loaded {steps['loaded']}, compiled otherwise {steps['fell_back']}")
    if args.report:
        _write_precompile_report(Path(args.report), report, seconds, learner, args)
    if report["compile_cache_loaded"]:
        print(f"already warm: loaded {report['compile_cache_file']} ({what}); nothing written; {seconds:.1f} s")
        return 0
    if not report["compile_cache_saved"]:
        print(
            f"no cache file written: torch left no cache artifacts (compile_backend={cfg.compile_backend}; "
            f"only Inductor writes them) for {what}; {seconds:.1f} s"
        )
        return 1
    size = Path(report["compile_cache_file"]).stat().st_size
    print(f"wrote {report['compile_cache_file']} ({size} bytes; {what}) in {seconds:.1f} s")
    return 0


def _write_precompile_report(path: Path, report: dict, seconds: float, learner: "FlashSACLearner", args: argparse.Namespace) -> None:
    """precompile's JSON: what it did and where the compile time went, with provenance."""
    import datetime
    import json

    import torch

    device, cfg = report["device"], learner.cfg
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "experiment": "precompile",
        "seconds_total": seconds,  # the command's own work: config, learner, compile, capture, cache file
        **report,
        "config": {"learner_mode": learner.engine.mode, "batch_size": cfg.batch_size, "updates_per_step": cfg.updates_per_step,
                   "dims": [args.obs_dim, args.critic_obs_dim, args.action_dim]},
        "environment": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None,
            "torch": torch.__version__, "cpus": os.cpu_count(),
            "inductor_compile_threads": _inductor_compile_threads(),
        },
        "command": " ".join(["flashsac-opt", *sys.argv[1:]]),
    }, indent=1))


def _inductor_compile_threads() -> int | None:
    try:
        from torch._inductor import config

        return int(config.compile_threads)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashsac-opt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print versions, device and UniLab availability").set_defaults(func=info)
    patch = sub.add_parser(
        "unilab",
        help="status / apply / revert flashsac_opt's patches on UniLab 1.5.2; placeholder G1 meshes",
        description="\n".join(_wrap(
            "status: UniLab's version and which of flashsac_opt's patches are applied. apply / "
            "revert: the patch series (atomic: all files or none; revert restores the "
            "byte-identical originals).", indent="")),
        epilog=PLACEHOLDER_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    patch.add_argument("action", choices=["status", "apply", "revert", "placeholder-meshes"])
    patch.add_argument("--root", help="a UniLab checkout (src/unilab/), a unilab package dir; default: the installed one")
    patch.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    patch.add_argument("--patch", action="append", help="only this patch (repeatable); default: the required ones")
    patch.add_argument("--with-cpu-smoke", action="store_true", help="apply: also the optional patches (CPU off-policy runs; data-parallel launch: CPU ranks, torchrun)")
    patch.set_defaults(func=unilab)
    pre = sub.add_parser(
        "precompile",
        help="compile (and capture) once for a UniLab configuration and write the compile cache file",
        description=PRECOMPILE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pre.add_argument("overrides", nargs="*", help="Hydra overrides of the UniLab config (key=value)")
    pre.add_argument("--config", help="UniLab's conf/flashsac/config.yaml (default: the installed one)")
    pre.add_argument("--obs-dim", type=int, default=98, help="actor observation dim (default: G1's 98)")
    pre.add_argument("--critic-obs-dim", type=int, default=101, help="critic observation dim (default: G1's 101)")
    pre.add_argument("--action-dim", type=int, default=29, help="action dim (default: G1's 29)")
    pre.add_argument("--device", help="default: cuda when available, else cpu")
    pre.add_argument("--report", metavar="FILE", help="also write what it did as JSON (seconds, compile phases, cache file, provenance)")
    pre.set_defaults(func=precompile)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
