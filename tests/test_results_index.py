"""Every number README.md and FLASH_SAC_OPTIMIZATION.md quote is checked against its evidence.

results/INDEX.md lists each quoted measurement: claim, value as printed, the document(s)
quoting it, the JSON file and the key holding it (its header defines the selector and
expression syntax and the "measured number" rule). These tests check that
(a) every row's file exists, its key resolves and the JSON value equals the printed value
    to the printed rounding;
(b) every row's printed value appears in each document it names;
(c) every measured number in README.md and FLASH_SAC_OPTIMIZATION.md is listed in INDEX.md
    for that document;
(d) every relative link in README.md and FLASH_SAC_OPTIMIZATION.md names a file or directory of
    the repository, and README links the trainings' table (results/trainings/summary.md) rather
    than copying it;
(e) no git-tracked text file names a work period ("session" and a number): a measurement is
    named by its date, commit and JSON.
The last tests feed the same checks wrong inputs, so each of them is known to be able to fail.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
from common import read_json  # noqa: E402  (plain or .json.gz, as the experiments read their reports)

INDEX = REPO / "results" / "INDEX.md"
DOCS = {"README": REPO / "README.md", "report": REPO / "FLASH_SAC_OPTIMIZATION.md"}
SUMMARY = "results/trainings/summary.md"  # the trainings' table, generated from its JSON; README links it

INDEXED_HEADER = ["claim", "printed", "doc", "file", "key"]
QUOTED_HEADER = ["claim", "printed", "doc", "source"]


# ---------------------------------------------------------------------------- INDEX.md
@dataclass(frozen=True)
class Row:
    line: int
    claim: str
    printed: str
    docs: tuple[str, ...]
    file: str = ""  # empty for a figure quoted from elsewhere (QUOTED_HEADER tables)
    key: str = ""

    @property
    def id(self) -> str:
        return f"INDEX.md:{self.line}:{self.printed}"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _unquote(cell: str) -> str:
    return cell[1:-1] if len(cell) >= 2 and cell[0] == cell[-1] == "`" else cell


def parse_index(text: str) -> list[Row]:
    """The rows of every table in INDEX.md whose header is INDEXED_HEADER or QUOTED_HEADER."""
    rows, header = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.lstrip().startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = cells if cells in (INDEXED_HEADER, QUOTED_HEADER) else []
            continue
        if not header or set("".join(cells)) <= set("-: "):
            continue
        assert len(cells) == len(header), f"INDEX.md:{number}: {len(cells)} cells, expected {len(header)}"
        values = dict(zip(header, (_unquote(c) for c in cells)))
        docs = tuple(d.strip() for d in values["doc"].split(","))
        assert set(docs) <= set(DOCS), f"INDEX.md:{number}: doc must be one of {sorted(DOCS)}, got {values['doc']!r}"
        if header == INDEXED_HEADER:
            rows.append(Row(number, values["claim"], values["printed"], docs, values["file"], values["key"]))
        else:
            assert values["source"], f"INDEX.md:{number}: a quoted figure needs its source"
            rows.append(Row(number, values["claim"], values["printed"], docs))
    return rows


@lru_cache(maxsize=None)
def index_rows() -> tuple[Row, ...]:
    return tuple(parse_index(INDEX.read_text()))


# ---------------------------------------------------------------------------- selectors
_SEGMENT = re.compile(r"""\.?(?:(?P<name>[A-Za-z_][\w/-]*)|\["(?P<quoted>[^"]+)"\])|\[(?P<inner>[^\]"]+)\]""")


def resolve(data, selector: str):
    """Value of a dotted path with list indices and filters, e.g.
    ``cells[variant=ours_graph,workload=W1].ms_median``, ``cases[0].worst_loss.rel``,
    ``final["critic.w"]``. A filter ``[k=v,...]`` must match exactly one list element."""
    value, pos = data, 0
    while pos < len(selector):
        m = _SEGMENT.match(selector, pos)
        if not m or m.end() == pos:
            raise KeyError(f"{selector!r}: cannot parse at {selector[pos:]!r}")
        pos = m.end()
        name = m.group("name") or m.group("quoted")
        if name is not None:
            if not isinstance(value, dict) or name not in value:
                raise KeyError(f"{selector!r}: no key {name!r}")
            value = value[name]
            continue
        inner = m.group("inner")
        if re.fullmatch(r"-?\d+", inner):
            if not isinstance(value, list):
                raise KeyError(f"{selector!r}: [{inner}] on a {type(value).__name__}")
            value = value[int(inner)]
            continue
        wanted = dict(part.split("=", 1) for part in inner.split(","))
        if not isinstance(value, list):
            raise KeyError(f"{selector!r}: filter [{inner}] on a {type(value).__name__}")
        found = [item for item in value if isinstance(item, dict) and all(k in item and str(item[k]) == v for k, v in wanted.items())]
        if len(found) != 1:
            raise KeyError(f"{selector!r}: filter [{inner}] matches {len(found)} elements, expected 1")
        value = found[0]
    return value


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expression: str, data) -> float:
    """A key: one selector, or selectors and numbers joined by + - * / and parentheses,
    each operator and parenthesis separated by spaces (``a / b``, ``100 * a``)."""
    values: dict[str, float] = {}
    parts = []
    for token in re.findall(r'(?:"[^"]*"|[^\s"])+', expression):  # a quoted key may hold spaces
        if token in ("+", "-", "*", "/", "(", ")") or re.fullmatch(r"\d+(\.\d+)?", token):
            parts.append(token)
            continue
        value = resolve(data, token)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{token!r} is {value!r}, not a number")
        name = f"v{len(values)}"
        values[name] = float(value)
        parts.append(name)

    def run(node):
        if isinstance(node, ast.Expression):
            return run(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](run(node.left), run(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -run(node.operand)
        if isinstance(node, ast.Name) and node.id in values:
            return values[node.id]
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        raise ValueError(f"{expression!r}: unsupported {ast.dump(node)}")

    return run(ast.parse(" ".join(parts), mode="eval"))


def matches_printed(value: float, printed: str) -> bool:
    """``printed`` is ``value`` rounded to the digits printed ("1.44": 2 decimals; "7.6e-3":
    one decimal of the mantissa; "1,720": units). Either rounding of a tie is accepted."""
    text = printed.replace(",", "")
    m = re.fullmatch(r"(-?\d+)(?:\.(\d+))?(?:e([-+]?\d+))?", text)
    if not m:
        raise ValueError(f"printed value {printed!r} is not a number")
    decimals = len(m.group(2) or "")
    exponent = int(m.group(3) or 0)
    half_step = 0.5 * 10.0 ** (exponent - decimals)
    return math.isfinite(value) and abs(value - float(text)) <= half_step * (1 + 1e-9)


@lru_cache(maxsize=None)
def load_json(file: str):
    return read_json(REPO / file)


def check_row(row: Row) -> str | None:
    """None if the row's file, key and printed value agree; otherwise what is wrong."""
    path = REPO / row.file
    if not row.file.startswith("results/") or not row.file.endswith((".json", ".json.gz")) or not path.is_file():
        return f"{row.id}: {row.file!r} is not a JSON file under results/"
    try:
        value = evaluate(row.key, load_json(row.file))
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as exc:
        return f"{row.id}: key {row.key!r} in {row.file}: {exc}"
    if not matches_printed(value, row.printed):
        return f"{row.id} ({row.claim}): {row.file} {row.key} = {value!r}, printed {row.printed}"
    return None


# ---------------------------------------------------------------------------- documents
_NUM = r"\d{1,3}(?:,\d{3})+(?!\d)|\d+(?:\.\d+)?(?:e[-+]?\d+)?"
# A unit after a space or attached; "x" only attached ("0.57x", "48x"; "256 x 2" is a shape).
_UNITS = r"GB/s|MiB|GiB|KiB|MB|GB|ms|us|µs|kernels|bytes|minutes|min|s|%"
_TOKEN = re.compile(
    rf"(?<![\w.^/])(?P<a>{_NUM})(?:(?P<dash>-|–| to )(?P<b>{_NUM}))?"
    rf"(?P<unit>\s?(?:{_UNITS})|x)?(?![\w])(?!\.\d)"
)
_BOUND = re.compile(r"(<=|>=|≤|≥|<|>)\s*$")


def prose(text: str) -> str:
    """What check (c) reads: the text without fenced code, inline code, HTML comments, link
    targets and URLs."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return re.sub(r"https?://\S+", " ", text)


def measured_numbers(text: str) -> list[str]:
    """The measured numbers of a document, as printed (see INDEX.md's header): in its prose,
    a number with a unit (ms, s, us, x, %, MiB, GiB, KiB, MB, GB, GB/s, kernels, bytes,
    minutes) or with a decimal point or exponent; a range "a-b unit" gives both ends.
    Not counted: versions (two or more dots), numbers after a comparison (<=, <, >, >=:
    targets and bounds), and identifiers (W1, B256, H200, 2^20)."""
    found = []
    body = prose(text)
    for m in _TOKEN.finditer(body):
        if _BOUND.search(body[: m.start()]):
            continue
        ends = [m.group("a")] + ([m.group("b")] if m.group("b") else [])
        has_unit = m.group("unit") is not None
        for number in ends:
            if has_unit or re.search(r"[.e]", number):
                found.append(number)
    return found


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def link_targets(text: str) -> list[str]:
    """The relative link targets of a markdown document (URLs and in-page anchors left out),
    without their own anchors."""
    targets = (t for t in _LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:|#", t))
    return [t.split("#", 1)[0] for t in targets]


def broken_links(text: str, root: Path = REPO) -> list[str]:
    return [t for t in link_targets(text) if not (root / t).exists()]


def number_appears(printed: str, text: str) -> bool:
    return any(m.group("a") == printed or m.group("b") == printed for m in _TOKEN.finditer(prose(text)))


def unindexed(doc: str, text: str, rows) -> list[str]:
    listed = {row.printed for row in rows if doc in row.docs}
    return sorted({n for n in measured_numbers(text) if n not in listed}, key=text.find)


# ---------------------------------------------------------------------------- the checks
INDEXED = [row for row in index_rows() if row.file]


def test_index_has_rows_for_both_documents():
    docs = {d for row in index_rows() for d in row.docs}
    assert docs == set(DOCS) and len(INDEXED) > 20


@pytest.mark.parametrize("row", INDEXED, ids=lambda row: row.id)
def test_a_row_resolves_to_its_printed_value(row):
    problem = check_row(row)
    assert problem is None, problem


def test_b_printed_values_appear_in_their_documents():
    texts = {doc: path.read_text() for doc, path in DOCS.items()}
    missing = [f"{row.id} not in {doc}" for row in index_rows() for doc in row.docs if not number_appears(row.printed, texts[doc])]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_c_every_measured_number_is_indexed(doc):
    missing = unindexed(doc, DOCS[doc].read_text(), index_rows())
    assert not missing, f"{DOCS[doc].name}: measured numbers not in results/INDEX.md for {doc!r}: {missing}"


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_d_every_relative_link_resolves(doc):
    broken = broken_links(DOCS[doc].read_text())
    assert not broken, f"{DOCS[doc].name}: links to nothing in the repository: {broken}"


def test_d_readme_links_the_trainings_table():
    assert SUMMARY in link_targets(DOCS["README"].read_text()) and (REPO / SUMMARY).is_file()


# ---------------------------------------------------------------------------- (e) work periods
# A work period named by number: "session" or "sessions", a space or a hyphen, digits (any case).
# The project names a measurement by its date, commit and JSON instead; Python's scope="session"
# and identifiers such as session_id pass.
WORK_PERIOD = re.compile(r"\bsessions?[ -]\d+", re.IGNORECASE)


def tracked_text_files(root: Path = REPO) -> list[str]:
    """The repository's git-tracked files that exist in the working tree, without .gz archives."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    names = [n for n in listed.decode().split("\0") if n and not n.endswith(".gz")]
    return [n for n in names if (root / n).is_file()]


def work_period_references(name: str, data: bytes) -> list[str]:
    """``name:line: match`` for each work period named in a text file; binary data (a NUL byte,
    or not UTF-8) is skipped."""
    if b"\0" in data:
        return []
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return []
    return [
        f"{name}:{number}: {m.group(0)}"
        for number, line in enumerate(text.splitlines(), 1)
        for m in WORK_PERIOD.finditer(line)
    ]


def test_e_no_tracked_text_file_names_a_work_period():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    found = [ref for name in tracked_text_files() for ref in work_period_references(name, (REPO / name).read_bytes())]
    files = sorted({ref.split(":", 1)[0] for ref in found})
    assert not found, (
        f"{len(found)} references to a work period in {len(files)} files (name the date, commit and JSON instead):\n"
        + "\n".join(found)
    )


# ------------------------------------------------------- the checks can fail (mutations)
def test_a_fails_on_a_drifted_value_a_bad_key_and_a_missing_file():
    row = INDEXED[0]
    value = evaluate(row.key, load_json(row.file))
    assert check_row(row) is None
    decimals = len(row.printed.partition(".")[2]) if "e" not in row.printed else 3
    drifted = f"{value + 2 * 10.0 ** -decimals + 1:.{decimals}f}"
    assert check_row(Row(row.line, row.claim, drifted, row.docs, row.file, row.key)) is not None
    assert check_row(Row(row.line, row.claim, row.printed, row.docs, row.file, row.key + ".nope")) is not None
    assert check_row(Row(row.line, row.claim, row.printed, row.docs, "results/nope.json", row.key)) is not None
    assert matches_printed(1.4449, "1.44") and matches_printed(1.4351, "1.44") and not matches_printed(1.446, "1.44")
    assert matches_printed(0.007329, "7.3e-3") and not matches_printed(0.00741, "7.3e-3")
    assert matches_printed(1720, "1,720") and not matches_printed(1721, "1,720")


def test_selectors_and_expressions():
    data = {"cells": [{"v": "a", "w": 1, "ms": 2.0}, {"v": "b", "w": 1, "ms": 4.0}], "x": {"y.z": [0, 5]}}
    assert resolve(data, "cells[v=b,w=1].ms") == 4.0 and resolve(data, 'x["y.z"][1]') == 5
    assert evaluate("cells[v=a,w=1].ms / cells[v=b,w=1].ms", data) == 0.5
    assert evaluate("100 * ( cells[0].ms - 1 )", data) == 100.0
    assert evaluate('x["y.z"][1] / 2', data) == 2.5 and resolve({"a b (c)": 1}, '["a b (c)"]') == 1
    for bad in ("cells[w=1].ms", "cells[v=c].ms", "cells.ms", "x.q"):
        with pytest.raises(KeyError):
            resolve(data, bad)


def test_b_fails_when_a_printed_value_is_not_in_the_document():
    assert number_appears("1.276", "graph mode 1.276 ms") and not number_appears("1.27", "graph mode 1.276 ms")
    assert not number_appears("1.276", "graph mode `1.276` ms")


def test_c_finds_measured_numbers_and_fails_on_an_unindexed_one():
    text = (
        "Graph 1.276 ms (0.57x), 344 kernels, 28-30 s, 13.0%, 48x, 116.2 MiB, 7.3e-3; "
        "UniLab 1.5.2, torch 2.11.0, batch 256 x 2, W1, 1000 iterations, target <= 0.5x, `0.01`, 2^20 rows.\n"
        "```bash\nrun --ms 9.99\n```\n<!-- 8.88 ms -->\n[JSON](results/x_7.77.json)\n"
    )
    assert measured_numbers(text) == ["1.276", "0.57", "344", "28", "30", "13.0", "48", "116.2", "7.3e-3"]
    rows = [Row(1, "c", n, ("README",), "f", "k") for n in measured_numbers(text)]
    assert unindexed("README", text, rows) == []
    assert unindexed("README", text, rows[1:]) == ["1.276"]
    assert unindexed("report", text, rows) != []  # rows for another document do not count


def test_d_fails_on_a_link_to_nothing():
    text = (
        "[report](FLASH_SAC_OPTIMIZATION.md), [table](results/trainings/summary.md#top), [UniLab](https://pypi.org/project/unilab/), "
        "[below](#tests), [gone](results/nope/nope.json), [moved](experiments/moved/nope.py)"
    )
    assert link_targets(text) == [
        "FLASH_SAC_OPTIMIZATION.md", "results/trainings/summary.md", "results/nope/nope.json", "experiments/moved/nope.py"
    ]
    assert broken_links(text) == ["results/nope/nope.json", "experiments/moved/nope.py"]
    assert SUMMARY not in link_targets("[table](results/trainings/summary.json)")


def test_e_fails_on_a_named_work_period():
    word = "sess" + "ion"  # spelled apart, so this file passes its own check
    text = (
        f"Measured in {word} 27.\nThe {word.title()}-28 call; {word}s 16-18; {word.upper()} 3 and 4\n"
        f'scope="{word}", {word}_id = 2, a {word}: 5 calls, {word}s, 2026-12-03 (commit 6c01f36)\n'
    )
    found = work_period_references("notes.md", text.encode())
    assert found == [
        f"notes.md:1: {word} 27",
        f"notes.md:2: {word.title()}-28",
        f"notes.md:2: {word}s 16",
        f"notes.md:2: {word.upper()} 3",
    ]
    assert work_period_references("blob.bin", b"\0" + text.encode()) == []  # binary: skipped
    assert work_period_references("latin1.txt", f"caf\xe9 {word} 9".encode("latin-1")) == []  # not UTF-8: skipped
    assert work_period_references("clean.md", b"2026-12-03, commit 6c01f36, results/x.json") == []
    names = tracked_text_files()
    assert "README.md" in names and not any(n.endswith(".gz") for n in names)
