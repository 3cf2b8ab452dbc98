"""The README and docs/ cannot rot (issue 30):

* every ```python block runs: the blocks of one page in order, in one fresh interpreter, from the
  repository root (a page's later blocks may use what its earlier ones defined);
* every command a page shows (```bash blocks, indented command lines, `jaggc ...` in tables) parses:
  `jaggc` commands through the real argument parser, `python -m X` and `torchrun ... -m X` by finding
  module X, `pytest PATH` by the path existing;
* the README stays under 15 KB, links to pages that exist, and names every page of docs/.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jaggc.cli import build_parser
from jaggc.verify.cli import build_parser as verify_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)


def blocks(page: Path, language: str) -> list[str]:
    return [body for lang, body in _FENCE.findall(page.read_text()) if lang == language]


def command_lines(page: Path) -> list[str]:
    """Command lines a page shows: shell blocks, 4-space indented lines, and `...` spans that start
    with a command."""
    text = page.read_text()
    lines = [line for body in blocks(page, "bash") for line in body.splitlines()]
    prose = _FENCE.sub("", text)
    lines += [line.strip() for line in prose.splitlines() if line.startswith("    ") and not line.startswith("     ")
              and re.match(r"\s+(\S+=\S+ )*(\.venv/bin/)?(jaggc|python|torchrun|pytest) ", line)]
    lines += re.findall(r"`((?:\.venv/bin/)?jaggc [a-z][^`]*)`", prose)
    return [line for line in lines if line.strip() and not line.strip().startswith("#")]


def _commands(line: str) -> list[list[str]]:
    out = []
    for part in re.split(r"&&|\|", line):
        try:
            words = shlex.split(part)
        except ValueError:
            continue
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]          # environment assignments
        if words:
            out.append(words)
    return out


def check_command(words: list[str]) -> str | None:
    """Why the command would not run as written, or None."""
    prog = words[0].rsplit("/", 1)[-1]
    if prog == "jaggc":
        argv = [w for w in words[1:] if w not in ("...", "[...]")]
        if "..." in " ".join(argv) or any(w.startswith("[") or w.endswith("]") or "|" in w for w in argv):
            argv = [w for w in argv if not (w.startswith("[") or w.endswith("]") or "|" in w)]
        try:
            if argv[:1] == ["verify"]:
                verify_parser().parse_args(argv[1:])
            elif argv:
                build_parser().parse_args(argv)
        except SystemExit as e:
            return f"argparse exits {e.code}"
        return None
    if prog in ("python", "python3") or prog == "torchrun":
        if "-m" in words:
            module = words[words.index("-m") + 1]
            if importlib.util.find_spec(module) is None:
                return f"no module {module}"
        return None
    if prog == "pytest":
        paths = [w.split("::")[0] for w in words[1:] if not w.startswith("-") and "/" in w]
        missing = [p for p in paths if not (ROOT / p).exists()]
        return f"missing {missing}" if missing else None
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_a_page_shows_parses(page):
    bad = []
    for line in command_lines(page):
        for words in _commands(line):
            if words[0].rsplit("/", 1)[-1] in ("pip", "cd", "python3") and "-m" not in words:
                continue
            why = check_command(words)
            if why:
                bad.append(f"{line!r}: {why}")
    assert not bad, f"{page.name}: commands that would not run as written:\n" + "\n".join(bad)


def test_the_command_check_can_fail():
    assert check_command(["jaggc", "bench", "--no-such-option"])
    assert check_command(["python", "-m", "jaggc_studies.no_such_module"])
    assert check_command(["pytest", "tests/test_no_such_file.py"])
    assert check_command(["jaggc", "bench", "--quick"]) is None


PYTHON_PAGES = [p for p in PAGES if blocks(p, "python")]


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=lambda p: p.name)
def test_every_python_block_runs(page, tmp_path):
    script = tmp_path / f"{page.stem}_blocks.py"
    script.write_text("\n\n".join(f"# --- block {i}\n{body}" for i, body in enumerate(blocks(page, "python"))))
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{page.name}'s python blocks fail:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"


def test_the_readme_is_short_links_resolve_and_names_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 15_000, len(readme.encode())
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert not [l for l in links if not l.startswith("http") and not (ROOT / l).exists()]
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme or f"({page.name})" in readme, f"README does not link {page.name}"


def test_every_docs_link_resolves():
    bad = []
    for page in PAGES:
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not link.startswith("http") and not (page.parent / link).exists():
                bad.append(f"{page.name}: {link}")
    assert not bad, bad


def test_the_api_reference_is_generated_from_the_code_and_covers_every_public_name():
    from jaggc_studies import api_reference

    page = (ROOT / "docs" / "api.md").read_text()
    assert page == api_reference.render(), (
        "docs/api.md is stale: python -m jaggc_studies.api_reference --out docs/api.md")
    import jaggc
    import jaggc.grpo
    import jaggc.models
    import jaggc.verify

    for module in (jaggc, jaggc.grpo, jaggc.models, jaggc.verify):
        for name in api_reference.public_names(module):
            assert f"### `{module.__name__}.{name}" in page, f"{module.__name__}.{name} missing from docs/api.md"
    undocumented = [line for line in page.split("\n### ")[1:] if "\n\n" not in line.strip("\n")]
    assert not undocumented, f"public names without a docstring: {[u.splitlines()[0] for u in undocumented]}"


def test_the_source_cites_only_what_the_repository_holds():
    """A citation of a section of a document the repository does not hold ("spec §2.5") cannot be
    followed: cite a docs/ page, or the paper (arXiv 2607.17572)."""
    bad = []
    for folder in ("jaggc", "passes", "verify", "studies", "docs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".md"):
                for lineno, line in enumerate(path.read_text().splitlines(), 1):
                    if re.search(r"\bspec\s*§|§\s*\d", line) or "docs/background/" in line:
                        bad.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not bad, "citations of documents not in the repository:\n" + "\n".join(bad)


def test_every_public_name_has_a_docstring_of_its_own():
    """docs/api.md shows each public name's docstring: a dataclass without one shows its generated
    signature again (``Report(path: str, ...)``), which says nothing."""
    import jaggc

    bare = [name for name in jaggc.__all__
            if not (doc := (getattr(jaggc, name).__doc__ or "").strip()) or doc.startswith(f"{name}(")]
    assert not bare, f"public names without a docstring: {bare}"


def test_ci_runs_the_readme_test_command():
    """CI must run the command README gives for the tests (the quick start's second line), as written."""
    quick_start = blocks(ROOT / "README.md", "bash")[0].strip().splitlines()
    assert len(quick_start) == 2 and quick_start[1].startswith(".venv/bin/python -m pytest"), quick_start
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert quick_start[1] in ci, (quick_start[1], ci)
