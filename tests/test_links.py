"""Every relative link in README.md, docs/*.md and the experiments' READMEs
resolves to a file or folder of the repository."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                *(ROOT / "experiments").rglob("*.md")])


def relative_links(page: pathlib.Path) -> list[str]:
  text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks
  return [t for t in LINK.findall(text)
          if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]  # skip URLs and anchors


def test_every_relative_link_resolves():
  broken = []
  for page in PAGES:
    for target in relative_links(page):
      path = target.split("#", 1)[0]
      if not (page.parent / path).exists():
        broken.append(f"{page.relative_to(ROOT)}: {target}")
  assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_check_finds_links():
  assert "docs/benchmarks.md" in relative_links(ROOT / "README.md")
