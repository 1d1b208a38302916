"""Where a training's start-up goes: periodic Python stack samples of UniLab's `train` and of
every Python process it starts, without a profiler (the device machines have none).

`enable(env, folder, interval_s, for_s)` puts a `sitecustomize.py` first on the training's
PYTHONPATH. Every Python process the training starts (train itself, UniLab's collector
processes, a compile-ahead child) imports it at start-up and has `faulthandler` write the stacks
of all its threads to FOLDER/stacks_<pid>.txt every interval_s seconds for its first for_s
seconds. faulthandler's watchdog is a C thread: it needs no GIL, so the samples keep their
pace while Python is busy (a long C call, e.g. a compiler subprocess wait, shows as that call).

`summarize(folder, launched, until_s)` reads the samples taken before until_s seconds after
launch and, per process, takes each sample's main-thread stack (the thread not started by
`threading`), names it by its innermost UniLab / flashsac_opt frame and the library it was in
below that (e.g. `unilab/envs/mdp/events.py:_bind_root_reset > torch/_inductor`), and reports
the seconds per name and the runs of consecutive samples with one name (segments).
An existing sitecustomize.py further down the path is shadowed while sampling is on.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

FOLDER_ENV, INTERVAL_ENV, FOR_ENV = "FLASHSAC_OPT_STACK_DIR", "FLASHSAC_OPT_STACK_INTERVAL", "FLASHSAC_OPT_STACK_SECONDS"
SITECUSTOMIZE = f'''"""Written by flashsac_opt's experiments/report/startup_stacks.py: stack samples of this process."""
import faulthandler, os, threading, time
_folder = os.environ.get("{FOLDER_ENV}")
if _folder:
    _file = open(os.path.join(_folder, "stacks_%d.txt" % os.getpid()), "w")
    try:
        with open("/proc/self/cmdline", "rb") as _c:
            _cmd = _c.read().replace(b"\\0", b" ").decode(errors="replace").replace("\\n", " ").strip()
    except OSError:
        _cmd = "?"
    _file.write("# started %.3f pid %d cmd %s\\n" % (time.time(), os.getpid(), _cmd[:300]))
    _file.flush()
    faulthandler.dump_traceback_later(float(os.environ.get("{INTERVAL_ENV}", "0.5")), repeat=True, file=_file)
    _stop = threading.Timer(float(os.environ.get("{FOR_ENV}", "300")), faulthandler.cancel_dump_traceback_later)
    _stop.daemon = True
    _stop.start()
'''
APP = ("/unilab/", "/flashsac_opt/")
_HEADER = re.compile(r"^# started (?P<t>[0-9.]+) pid (?P<pid>\d+) cmd (?P<cmd>.*)$")
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line \d+ in (?P<func>\S+)')


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


def _samples(text: str) -> list[list[tuple[str, str]]]:
    """Each dump's main-thread stack (innermost first): the thread whose outermost frame is not
    threading's bootstrap (threads started by `threading`, the sampler's timer among them)."""
    out = []
    for dump in re.split(r"^Timeout \([0-9:.]+\)!$", text, flags=re.M)[1:]:
        for thread in re.split(r"^(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$", dump, flags=re.M)[1:]:
            stack = [(m["file"], m["func"]) for m in map(_FRAME.match, thread.splitlines()) if m]
            if stack and not stack[-1][0].endswith("threading.py"):
                out.append(stack)
                break
    return out


def summarize(folder: Path, launched: float, until_s: float | None = None, interval_s: float | None = None) -> list[dict]:
    """Per sampled process (oldest first): its command, start (s since launch), and where its main
    thread was in the samples before ``until_s`` s after launch: seconds per name (largest first)
    and the segments of consecutive samples with one name (at least two samples)."""
    interval = interval_s if interval_s is not None else float(os.environ.get(INTERVAL_ENV, "0.5"))
    procs = []
    for path in sorted(folder.glob("stacks_*.txt")):
        text = path.read_text(errors="replace")
        head = _HEADER.match(text.split("\n", 1)[0])
        if not head:
            continue
        started = float(head["t"]) - launched
        names = [name_of(s) for s in _samples(text)]
        if until_s is not None:  # the k-th sample is taken (k + 1) intervals after the process started
            names = names[: max(0, int((until_s - started) / interval))]
        segments, start = [], 0
        for k in range(1, len(names) + 1):
            if k == len(names) or names[k] != names[start]:
                if k - start >= 2:
                    segments.append({"start_s": round(started + (start + 1) * interval, 1),
                                     "seconds": round((k - start) * interval, 1), "where": names[start]})
                start = k
        procs.append({"pid": int(head["pid"]), "cmd": head["cmd"], "started_s": round(started, 2), "samples": len(names),
                      "seconds_by_where": [[w, round(n * interval, 1)] for w, n in Counter(names).most_common(15)],
                      "segments": segments})
    return sorted(procs, key=lambda p: p["started_s"])
