"""Docs said once: the tree in docs/architecture.md (the one tree; the README links to
it) names every module of the package; the README's headline figures are those of the
sample run it prints; its first screen shows the set-up, main-job and test commands CI
runs; no doc or code comment names an issue number."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("raykv", "controllers", "cache_actors", "clusters", "integrations",
            "example_engine", "lab")


def tree() -> str:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    return doc.split("## The tree, by the process that runs it", 1)[1].split("```", 2)[1]


def modules() -> list[str]:
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                            "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    return [f for f in files if f.split("/")[0] in PACKAGES
            and not f.endswith("__init__.py")]


def unlisted(text: str, files: list[str]) -> list[str]:
    """The files whose name (``x.py``) ``text`` does not name."""
    return [f for f in files
            if not re.search(rf"(?<![\w.]){re.escape(Path(f).name)}(?!\w)", text)]


def test_the_tree_names_every_module():
    files = modules()
    assert len(files) > 100
    assert unlisted(tree(), files) == []
    # CONTROL: a module the tree does not name is caught
    assert unlisted(tree(), ["controllers/no_such_module.py"]) == [
        "controllers/no_such_module.py"]


def test_the_readme_headline_quotes_its_sample_run():
    readme = (ROOT / "README.md").read_text()
    headline = " ".join(readme.split("## ", 1)[0].split("```", 1)[0].split())
    sample = readme.split("It prints a table of every request", 1)[1].split("```", 2)[1]
    cross, local = re.findall(r"\*{0,2}([\d.]+x) lower\*{0,2} (?:restored )?from",
                              headline)[:2]
    assert f"({cross} lower;" in sample and f"({local} lower)" in sample, (cross, local)
    shares = re.search(r"(\d+)% of prompt tokens come from the local pool, (\d+)% from the "
                       r"other node and (\d+)% are computed", headline)
    assert shares, headline
    l2, l3, computed = shares.groups()
    assert f"L2 (local host pool) {l2}%, L3 (Mooncake) {l3}%, computed {computed}%" in sample


def test_no_issue_numbers_in_docs_or_code():
    files = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.sh", "*.yaml"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    pattern = re.compile(r"\bissue #?\d+", re.I)
    found = [f for f in files if not f.startswith("tests/")
             and pattern.search((ROOT / f).read_text())]
    assert found == []


def outside_links(doc: Path) -> list[str]:
    """Links of the markdown file ``doc`` that leave the repository or name no file in it."""
    def inside(target: str) -> bool:
        if re.match(r"[a-z]+:", target) or target.startswith("/"):
            return False  # a web link or an absolute path
        path = doc.parent / target.split("#", 1)[0]
        return path.resolve().is_relative_to(ROOT) and path.exists()

    return [t for t in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()) if not inside(t)]


def test_docs_link_only_inside_the_repository(tmp_path):
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert {str(d.name): outside_links(d) for d in docs} == {d.name: [] for d in docs}
    # CONTROL: a web link, an absolute path and a missing file are caught
    doc = tmp_path / "x.md"
    doc.write_text("[a](https://example.org) [b](/tmp/notes.md) [c](missing.md)")
    assert len(outside_links(doc)) == 3


FIRST_SCREEN = 40
COMMANDS = ("scripts/setup.sh", "raykv demo", "python -m pytest -q")
"""The set-up, the main job and the test command, as ``.ci/run`` runs them."""


def commands_missing(readme: str) -> list[str]:
    """The ``COMMANDS`` that do not begin a line of a shell block within the README's
    first ``FIRST_SCREEN`` lines."""
    screen = "\n".join(readme.splitlines()[:FIRST_SCREEN])
    lines = [line.strip() for block in re.findall(r"```bash\n(.*?)```", screen, re.S)
             for line in block.splitlines()]
    return [c for c in COMMANDS if not any(line.startswith(c) for line in lines)]


def test_the_readme_first_screen_shows_the_three_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert commands_missing(readme) == []
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert all(any(line.startswith(c) for line in ci) for c in COMMANDS)
    # CONTROL: the same README with its commands pushed below the first screen
    pushed = readme.replace("```bash\nscripts/setup.sh", "\n" * FIRST_SCREEN +
                            "```bash\nscripts/setup.sh", 1)
    assert commands_missing(pushed) == list(COMMANDS)
