"""Where a training's start-up goes: periodic samples of the main-thread Python stack of UniLab's
`train` and of every Python process it starts, without a profiler (the device machines have none).

`enable(env, folder, interval_s, for_s)` puts a `sitecustomize.py` first on the training's
PYTHONPATH: every Python process the training starts (train, UniLab's collectors, Inductor's
compile workers, a compile-ahead child, and children forked from any of them, such as the collector
forked from patch 0005's server) then runs a daemon thread that, every interval_s seconds
for its first for_s seconds, appends the main thread's frames (`sys._current_frames`) and the time
to FOLDER/stacks_<pid>.txt. A sample needs the GIL, so it is late while the main thread holds it
in a long C call. (faulthandler's watchdog, which needs no GIL, crashed UniLab's collector.)
`summarize(folder, launched, until_s)` names each sample by its innermost UniLab / flashsac_opt
frame and the library below it (`unilab/envs/mdp/events.py:_bind_root_reset > torch/_dynamo`) and
reports, per process, the seconds per name and its runs of consecutive samples (segments).
An existing sitecustomize.py further down the path is shadowed while sampling is on.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

FOLDER_ENV, INTERVAL_ENV, FOR_ENV = "FLASHSAC_OPT_STACK_DIR", "FLASHSAC_OPT_STACK_INTERVAL", "FLASHSAC_OPT_STACK_SECONDS"
SITECUSTOMIZE = f'''"""Written by flashsac_opt's experiments/report/startup_stacks.py: samples of this process's main-thread stack."""
import os, sys, threading, time
def _flashsac_opt_sample(folder, interval, duration, forked_from=None):
    main = threading.main_thread().ident
    try:
        with open("/proc/self/cmdline", "rb") as c:
            cmd = c.read().replace(b"\\0", b" ").decode(errors="replace").replace("\\n", " ").strip()
    except OSError:
        cmd = "?"
    if forked_from is not None:  # a forked child keeps its parent's command line
        cmd = "(forked from %d) %s" % (forked_from, cmd)
    end = time.time() + duration
    with open(os.path.join(folder, "stacks_%d.txt" % os.getpid()), "w") as out:
        out.write("# started %.3f pid %d cmd %s\\n" % (time.time(), os.getpid(), cmd[:300]))
        while time.time() < end:
            time.sleep(interval)
            frame = sys._current_frames().get(main)
            if frame is None:  # the main thread has ended
                break
            lines = ["@ %.3f" % time.time()]
            while frame is not None and len(lines) < 80:
                lines.append("%s\\t%s" % (frame.f_code.co_filename, frame.f_code.co_name))
                frame = frame.f_back
            out.write("\\n".join(lines) + "\\n")
            out.flush()
def _flashsac_opt_start(forked_from=None):
    threading.Thread(target=_flashsac_opt_sample, name="flashsac_opt_stack_sampler", daemon=True,
                     args=(os.environ["{FOLDER_ENV}"], float(os.environ.get("{INTERVAL_ENV}", "0.5")),
                           float(os.environ.get("{FOR_ENV}", "300")), forked_from)).start()
if os.environ.get("{FOLDER_ENV}"):
    _flashsac_opt_start()
    # A fork keeps no thread but the forking one: UniLab's collector, forked from patch 0005's
    # server, would go unsampled. Each forked child samples itself from its fork on.
    os.register_at_fork(after_in_child=lambda: _flashsac_opt_start(os.getppid()))
'''
APP = ("/unilab/", "/flashsac_opt/")
_HEADER = re.compile(r"^# started (?P<t>[0-9.]+) pid (?P<pid>\d+) cmd (?P<cmd>.*)$")


def enable(env: dict, folder: Path, interval_s: float = 0.5, for_s: float = 300.0) -> None:
    """Sample every Python process started with ``env`` (see the module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("stacks_*.txt"):
        old.unlink()
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH", "")) if p)
    env.update({FOLDER_ENV: str(folder), INTERVAL_ENV: str(interval_s), FOR_ENV: str(for_s)})


def _short(path: str) -> str:
    """The path from its package on: .../site-packages/torch/_inductor/x.py -> torch/_inductor/x.py."""
    m = re.search(r"/(?:site|dist)-packages/(.*)$", path) or re.search(r"/lib/python3\.\d+/(.*)$", path)
    path = m.group(1) if m else path
    if "/flashsac_opt/" in path:  # (it has a subpackage named unilab)
        return "flashsac_opt/" + path.split("/flashsac_opt/", 1)[1]
    if "/unilab/" in path:  # the last one: a copy of the package may sit in a folder named unilab
        return "unilab/" + path.rsplit("/unilab/", 1)[1]
    return path.lstrip("/")


def name_of(stack: list[tuple[str, str]]) -> str:
    """A main-thread stack (innermost frame first) named by its innermost application frame and
    the library the stack was in below it."""
    for depth, (path, func) in enumerate(stack):
        if any(app in path for app in APP):
            below = stack[depth - 1][0] if depth else None
            lib = "/".join(_short(below).split("/")[:2]) if below and not any(a in below for a in APP) else None
            return f"{_short(path)}:{func}" + (f" > {lib}" if lib else "")
    path, func = stack[0]
    return f"{_short(path)}:{func}"


def _samples(text: str) -> list[tuple[float, list[tuple[str, str]]]]:
    """Each sample's (time, main-thread stack innermost first)."""
    out = []
    for block in text.split("\n@ ")[1:]:
        stamp, *frames = block.rstrip("\n").split("\n")
        stack = [tuple(f.split("\t", 1)) for f in frames if "\t" in f]
        if stack:
            out.append((float(stamp), stack))
    return out


def name_in_library(stack: list[tuple[str, str]], depth: int = 3) -> str:
    """A main-thread stack named by its innermost ``depth`` frames (innermost last): where inside
    torch a compile spends its time, which ``name_of`` sums into one application frame."""
    return " < ".join(f"{_short(path)}:{func}" for path, func in reversed(stack[:depth]))


def summarize(folder: Path, launched: float, until_s: float | None = None, since_s: float | None = None,
              namer=name_of) -> list[dict]:
    """Per sampled process (oldest first): its command, start (s since launch), and where its main
    thread was in the samples taken before ``until_s`` (and from ``since_s``) s after launch:
    seconds per name (largest first; each sample counts the time since the one before) and the
    segments of consecutive samples with one name (at least two samples). ``namer``: name_of, or
    name_in_library for the frames inside a library."""
    procs = []
    for path in sorted(folder.glob("stacks_*.txt")):
        text = path.read_text(errors="replace")
        head = _HEADER.match(text.split("\n", 1)[0])
        if not head:
            continue
        started = float(head["t"]) - launched
        samples = [(t - launched, namer(stack)) for t, stack in _samples(text)]
        if until_s is not None:
            samples = [s for s in samples if s[0] <= until_s]
        first_at = started
        if since_s is not None:
            earlier = [t for t, _ in samples if t < since_s]
            first_at = max(earlier) if earlier else started
            samples = [s for s in samples if s[0] >= since_s]
        spans = [(t, t - (samples[k - 1][0] if k else first_at), nm) for k, (t, nm) in enumerate(samples)]
        seconds: Counter = Counter()
        for _, dt, name in spans:
            seconds[name] += dt
        segments, first = [], 0
        for k in range(1, len(spans) + 1):
            if k == len(spans) or spans[k][2] != spans[first][2]:
                if k - first >= 2:
                    start = spans[first][0] - spans[first][1]
                    segments.append({"start_s": round(start, 1), "seconds": round(spans[k - 1][0] - start, 1), "where": spans[first][2]})
                first = k
        procs.append({"pid": int(head["pid"]), "cmd": head["cmd"], "started_s": round(started, 2), "samples": len(spans),
                      "seconds_by_where": [[w, round(v, 1)] for w, v in seconds.most_common(15)], "segments": segments})
    return sorted(procs, key=lambda p: p["started_s"])
