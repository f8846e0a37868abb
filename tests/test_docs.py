"""The README and docs/ kept true to the code: the flags table against the server's own
`--help`, the layout tables (the README's, a line a package; docs/architecture.md's, every
module) against the packages and modules, and every pointer at a doc against its file and
section."""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PACKAGES = ("kernels", "model", "runtime", "server", "profiling")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(path: pathlib.Path) -> list[str]:
    return re.findall(r"^#+ (.*)$", path.read_text(), flags=re.M)


def _table_rows(text: str, header: str) -> list[str]:
    lines = text.split("\n")
    start = lines.index(header)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_the_readme_stays_short():
    assert README.count("\n") <= 350


def test_the_flags_table_lists_exactly_the_servers_flags():
    help_text = subprocess.run([sys.executable, "-m", "server", "--help"], cwd=ROOT,
                               capture_output=True, text=True).stdout  # absl exits 1 on --help
    own = help_text.split("server/__main__.py:")[1].split("\n\n")[0]
    served = set(re.findall(r"^  --(?:\[no\])?(\w+):", own, flags=re.M))
    rows = _table_rows(README, "| flag | default | meaning |")
    listed = {name.replace("-", "_") for row in rows
              for name in re.findall(r"`--([\w-]+)`", row.split("|")[1])}
    assert served - listed == set(), "flags the README's table lacks"
    assert listed - served == set(), "flags in the README's table the server lacks"


def test_the_readme_stays_a_ten_minute_read():
    assert len(README.encode()) <= 25_000


def test_the_readme_names_every_package_and_architecture_every_module_and_doc():
    packages = {re.search(r"`(\w+)/`", row).group(1)
                for row in _table_rows(README, "| package | what it holds |")}
    assert packages == {*PACKAGES, "tests", "docs"}
    rows = {re.search(r"`(\w+)/`", row).group(1): row
            for row in _table_rows((ROOT / "docs" / "architecture.md").read_text(),
                                   "| package | what it holds |")}
    missing = [f"{package}/{path.relative_to(ROOT / package)}"
               for package in PACKAGES for path in (ROOT / package).rglob("*.py")
               if path.name != "__init__.py" and f"`{path.name}`" not in rows[package]
               and f"`{path.relative_to(ROOT / package)}`" not in rows[package]]
    missing += [f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md")
                if f"`{path.name}`" not in rows["docs"]]
    assert missing == []


def test_links_in_the_readme_and_docs_reach_their_files_and_sections():
    broken = []
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if target.startswith("http"):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.name}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in map(_anchor, _headings(file)):
                broken.append(f"{doc.name}: {target}")
    assert broken == []


def test_code_comments_cite_sections_that_exist():
    cited = []
    for package in (*PACKAGES, "tests"):
        for path in (ROOT / package).rglob("*.py"):
            text = re.sub(r"\s*\n\s*(#\s*)?", " ", path.read_text())
            cited += [(path.name, doc, section) for doc, section in
                      re.findall(r"\((docs/\w+\.md), \"([^\"]+)\"\)", text)]
    assert cited, "no citations found: the pattern is wrong"
    wrong = [c for c in cited if not any(h.startswith(c[2]) for h in _headings(ROOT / c[1]))]
    assert wrong == []
