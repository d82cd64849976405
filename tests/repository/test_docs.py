"""The user docs hold together: links resolve, nothing points outside the repository or at an
issue tracker, and the README's cheap commands run.

Checked in README.md, CHANGELOG.md and every docs/*.md:

- every relative link (inline `[text](target)`, image or reference definition) names a file or
  folder of the repository, and a `#anchor` into a Markdown file names one of its headings,
  slugged as GitHub slugs them (lowercase; letters, digits, `_`, `-` and spaces kept, spaces
  become `-`; a repeated heading gets `-1`, `-2`, ...);
- no doc names a path above the repository (`../` outside a link target: paths in prose and
  code are written from the repository root, so any climbs out of it);
- outside code blocks and code spans, no doc cites an issue or pull request by number (`#12`,
  `(#20)`, `issue 27`, `PR 7`). A number cited with its repository (`vllm-project/vllm#1440`,
  `vllm#1440`) is a source citation and allowed; headings (`## ...`), HTML entities (`&#38;`)
  and colours (`color: #333`) are not references;
- README.md and docs/*.md link nothing outside the repository (`http...`); a source is cited
  as plain text. The CHANGELOG keeps its one link to the Keep a Changelog format.

The runnable marker: a fenced code block in README.md whose info string is `bash runnable`
(```` ```bash runnable ````) holds commands that are cheap (a few seconds, no network, no
cloud, nothing written) and must exit 0. Each line is one command, run from the repository
root through the project's virtual environment (`.venv/bin/...`, or the environment running
these tests) with a 60 s limit. Mark only such commands; a plain ```` ```bash ```` block is
documentation only.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from tests.conftest import REPO

DOCS = sorted(
    [REPO / "README.md", REPO / "CHANGELOG.md", *(REPO / "docs").glob("*.md")],
    key=lambda p: p.relative_to(REPO).as_posix(),
)
NO_EXTERNAL_LINKS = [p for p in DOCS if p.name != "CHANGELOG.md"]
RUNNABLE = "runnable"
COMMAND_TIMEOUT_S = 60

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"
)
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(?P<target>\S+?)>?(?:\s|$)", re.M)
HTML_ID = re.compile(r"<a\s[^>]*\b(?:name|id)=[\"']([^\"']+)[\"']", re.I)
ATX_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(?P<text>.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
PARENT_PATH = re.compile(r"(?<![\w.])(?:\.\./)+[^\s`)\]'\"]*")
# `#` and a number, not glued to a word, a path, an entity or another `#`, and not the start
# of a longer token (`#1a2b3c`, `#12-b`).
HASH_NUMBER = re.compile(r"(?<![\w/&#])#(?P<n>\d{1,6})(?![\w-])")
COLOUR_CONTEXT = re.compile(r"(?:colou?r|fill|stroke|background)\s*[:=]\s*[\"']?$", re.I)
WORDED_NUMBER = re.compile(r"\b(?:issues?|PRs?|pull requests?)\s+#?\d+\b", re.I)


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def split_fences(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(the prose lines, with every fenced block's lines blanked; the fenced blocks as
    (info string, lines with the fence's indent removed))."""
    prose: list[str] = []
    blocks: list[tuple[str, list[str]]] = []
    open_fence: tuple[str, int] | None = None
    for line in text.splitlines():
        if open_fence is None:
            m = FENCE.match(line)
            if m:
                open_fence = (m["fence"], len(m["indent"]))
                blocks.append((m["info"].strip(), []))
                prose.append("")
                continue
            prose.append(line)
            continue
        fence, indent = open_fence
        stripped = line.strip()
        if stripped.startswith(fence[0] * len(fence)) and set(stripped) == {fence[0]}:
            open_fence = None
        else:
            body = line[indent:] if line[:indent].strip() == "" else line.lstrip()
            blocks[-1][1].append(body)
        prose.append("")
    return prose, blocks


def prose_of(path: Path) -> str:
    """The doc without fenced blocks and code spans (each replaced by blanks, lines kept)."""
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    return CODE_SPAN.sub(lambda m: " " * len(m.group(0)), "\n".join(prose))


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    kept = "".join(
        c
        for c in text.lower()
        if c in " -" or unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Pc"
    )
    return kept.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    """Every `#anchor` GitHub gives the Markdown file: its headings' slugs, numbered when
    repeated, and explicit `<a name=...>` / `id=...` anchors."""
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    anchors: set[str] = set()
    for line in prose:
        m = ATX_HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m["text"])
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    anchors.update(HTML_ID.findall("\n".join(prose)))
    return anchors


def links_of(path: Path) -> list[str]:
    text = prose_of(path)
    return [m["target"] for m in INLINE_LINK.finditer(text)] + [
        m["target"] for m in REFERENCE_DEF.finditer(text)
    ]


def link_problem(doc: Path, target: str) -> str | None:
    """Why a relative link of `doc` does not resolve, or None."""
    if SCHEME.match(target) or target.startswith("//"):
        return None  # external: checked by test_docs_link_nothing_outside_the_repository
    path_part, _, anchor = target.partition("#")
    resolved = (doc.parent / path_part).resolve() if path_part else doc
    if resolved != REPO and REPO not in resolved.parents:
        return f"{target!r} points outside the repository"
    if not resolved.exists():
        return f"{target!r}: no such file or folder"
    if anchor and resolved.suffix == ".md" and anchor not in anchors_of(resolved):
        return f"{target!r}: {_rel(resolved)} has no heading with the anchor #{anchor}"
    return None


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_relative_link_resolves(doc: Path) -> None:
    problems = [p for t in links_of(doc) if (p := link_problem(doc, t))]
    assert not problems, f"{_rel(doc)}:\n" + "\n".join(problems)


def paths_above_the_repository(doc: Path) -> list[tuple[int, str]]:
    """(line number, path) for each `../` path the doc names outside a link target (link
    targets are relative to the doc and checked by `link_problem`)."""
    text = doc.read_text(encoding="utf-8")
    targets = [
        m.span("target") for m in (*INLINE_LINK.finditer(text), *REFERENCE_DEF.finditer(text))
    ]
    return [
        (text.count("\n", 0, m.start()) + 1, m.group(0))
        for m in PARENT_PATH.finditer(text)
        if not any(lo <= m.start() < hi for lo, hi in targets)
    ]


def test_a_path_above_the_repository_is_found_and_a_link_target_is_not(tmp_path: Path) -> None:
    doc = tmp_path / "d.md"
    doc.write_text("See [up](../README.md) and `.../x`.\nData in `../elsewhere/file.csv`.\n")
    assert paths_above_the_repository(doc) == [(2, "../elsewhere/file.csv")]


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_no_doc_names_a_path_above_the_repository(doc: Path) -> None:
    found = paths_above_the_repository(doc)
    assert not found, f"{_rel(doc)} names paths a clone does not have: {found}"


@pytest.mark.parametrize("doc", NO_EXTERNAL_LINKS, ids=_rel)
def test_docs_link_nothing_outside_the_repository(doc: Path) -> None:
    external = [t for t in links_of(doc) if SCHEME.match(t) or t.startswith("//")]
    assert not external, (
        f"{_rel(doc)} links outside the repository: {external} (cite a source as plain text)"
    )


def issue_references(text: str) -> list[tuple[int, str]]:
    """(line number, reference) for each issue or pull-request number a prose text cites (see
    the module doc)."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for m in HASH_NUMBER.finditer(line):
            if not COLOUR_CONTEXT.search(line[: m.start()]):
                found.append((number, m.group(0)))
        found += [(number, m.group(0)) for m in WORDED_NUMBER.finditer(line)]
    return found


def test_the_issue_pattern_is_precise() -> None:
    assert issue_references("speed work of issues #20/#16\nand (#19 item 5)") == [
        (1, "#20"),
        (1, "issues #20"),
        (2, "#19"),
    ]
    assert issue_references("see issue 27, or PR 7") == [(1, "issue 27"), (1, "PR 7")]
    for clean in (
        "## 3. A heading",
        "#### Headings",
        "vLLM pull request vllm-project/vllm#1440 and vllm#1926",
        '<span style="color: #333">grey</span>',
        "fill:#000000",
        "a colour #1a2b3c",
        "&#38; an entity",
        "an anchor [x](allocation.md#stack-config)",
        "C# and F#",
    ):
        assert issue_references(clean) == [], clean


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_no_doc_cites_an_issue_number(doc: Path) -> None:
    found = issue_references(prose_of(doc))
    assert not found, f"{_rel(doc)} cites issue numbers: {found}"


def runnable_commands() -> list[str]:
    """Each command of README.md's `bash runnable` blocks (a trailing `\\` continues a line)."""
    _, blocks = split_fences((REPO / "README.md").read_text(encoding="utf-8"))
    commands: list[str] = []
    for info, lines in blocks:
        words = info.split()
        if not words or words[0] != "bash" or RUNNABLE not in words[1:]:
            continue
        pending = ""
        for line in lines:
            line = pending + line.strip()
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def test_the_readme_marks_its_cheap_commands_runnable() -> None:
    commands = runnable_commands()
    assert len(commands) >= 5, commands
    assert any(c.split()[:3] == [".venv/bin/coral", "catalog", "models"] for c in commands)
    for command in commands:
        assert command.startswith(".venv/bin/"), f"runs outside the project's venv: {command}"


def _argv(command: str) -> list[str]:
    """The command's words, its `.venv/bin/X` run from the venv running these tests."""
    argv = shlex.split(command, comments=True)
    tool = argv[0].removeprefix(".venv/bin/")
    local = REPO / ".venv" / "bin" / tool
    argv[0] = str(local if local.exists() else Path(sys.executable).with_name(tool))
    return argv


@pytest.mark.parametrize("command", runnable_commands())
def test_every_runnable_readme_command_exits_0(command: str) -> None:
    r = subprocess.run(
        _argv(command),
        cwd=REPO,
        env=dict(os.environ, COLUMNS="100"),
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, f"{command} exited {r.returncode}:\n{r.stderr[-2000:]}"
