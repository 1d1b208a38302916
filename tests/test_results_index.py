"""Every number README.md and FLASH_SAC_OPTIMIZATION.md quote is checked against its evidence.

results/INDEX.md lists each quoted measurement: claim, value as printed, the document(s)
quoting it, the JSON file and the key holding it (its header defines the selector and
expression syntax and the "measured number" rule). These tests check that
(a) every row's file exists, its key resolves and the JSON value equals the printed value
    to the printed rounding;
(b) every row's printed value appears in each document it names;
(c) every measured number in README.md and FLASH_SAC_OPTIMIZATION.md is listed in INDEX.md
    for that document;
(d) README's generated table equals results/trainings/summary.md.
The last tests feed the same checks wrong inputs, so each of them is known to be able to fail.
"""

from __future__ import annotations

import ast
import math
import operator
import re
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
SUMMARY = REPO / "results" / "trainings" / "summary.md"
GENERATED_BEGIN = "<!-- generated: results/trainings/summary.md -->"
GENERATED_END = "<!-- end generated -->"

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
    targets, URLs and README's generated block (check (d) covers that one)."""
    text = re.sub(re.escape(GENERATED_BEGIN) + r".*?" + re.escape(GENERATED_END), " ", text, flags=re.S)
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


def generated_block(readme: str) -> str | None:
    m = re.search(re.escape(GENERATED_BEGIN) + r"\n(.*?)" + re.escape(GENERATED_END), readme, flags=re.S)
    return m.group(1) if m else None


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


def test_d_readme_generated_table_is_summary_md():
    block = generated_block(DOCS["README"].read_text())
    assert block is not None, f"README.md has no block between {GENERATED_BEGIN!r} and {GENERATED_END!r}"
    assert block == SUMMARY.read_text(), "README's generated table differs from results/trainings/summary.md: paste it again"


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
        f"{GENERATED_BEGIN}\n| 9.99 |\n{GENERATED_END}\n"
    )
    assert measured_numbers(text) == ["1.276", "0.57", "344", "28", "30", "13.0", "48", "116.2", "7.3e-3"]
    rows = [Row(1, "c", n, ("README",), "f", "k") for n in measured_numbers(text)]
    assert unindexed("README", text, rows) == []
    assert unindexed("README", text, rows[1:]) == ["1.276"]
    assert unindexed("report", text, rows) != []  # rows for another document do not count


def test_d_fails_on_an_edited_block():
    summary = SUMMARY.read_text()
    readme = f"x\n{GENERATED_BEGIN}\n{summary}{GENERATED_END}\n"
    assert generated_block(readme) == summary
    assert generated_block(readme.replace("(time limit)", "", 1)) != summary
