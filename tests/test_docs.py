"""The documentation: every relative link of the Markdown files reaches a file, and every
anchor a heading of it; the README keeps its setup commands and links every docs/ page."""

import glob
import os
import re

import pytest

from tests import helpers

ROOT = helpers.ROOT
PAGES = sorted(
    [os.path.join(ROOT, n) for n in ("README.md", "CONTRIBUTING.md", "REPRODUCTION.md",
                                     "CHANGELOG.md")]
    + glob.glob(os.path.join(ROOT, "docs", "*.md"))
    + [os.path.join(ROOT, "benchmarks", "README.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _strip_code(text: str) -> str:
  """The text without fenced code blocks and inline code (links there are not links)."""
  text = re.sub(r"```.*?```", "", text, flags=re.S)
  return re.sub(r"`[^`\n]*`", "", text)


def _anchors(path: str) -> set[str]:
  """GitHub's anchors of the headings of a Markdown file."""
  with open(path) as f:
    text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
  out = set()
  for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")
    out.add(slug)
  return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_reaches_a_file_and_a_heading(page):
  with open(page) as f:
    links = LINK.findall(_strip_code(f.read()))
  bad = []
  for link in links:
    if re.match(r"[a-z]+:", link):  # http(s), mailto: not checked offline
      continue
    target, _, anchor = link.partition("#")
    path = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
    if not os.path.exists(path):
      bad.append(f"{link}: no file {os.path.relpath(path, ROOT)}")
    elif anchor and (not path.endswith(".md") or anchor not in _anchors(path)):
      bad.append(f"{link}: no heading #{anchor}")
  assert not bad, bad


def test_the_readme_keeps_the_setup_commands_and_links_every_page():
  with open(os.path.join(ROOT, "README.md")) as f:
    readme = f.read()
  with open(os.path.join(ROOT, ".ci", "run")) as f:
    ci = f.read()
  # .ci/run runs the README's install and test commands: both are in both.
  for command in ("pip install -r requirements.txt -e .", "python -m pytest -q -n 3 tests"):
    assert command in readme and command in ci
  for page in glob.glob(os.path.join(ROOT, "docs", "*.md")):
    assert f"(docs/{os.path.basename(page)}" in readme, page


# A backticked repository path: under one of the repository's top-level folders; placeholders
# (<name>), patterns (*, p1…p4) and URLs are not paths.
_TOP = ("alma_jax/", "configs/", "launch/", "tests/", "docs/", "benchmarks/", ".ci/")
_INLINE = re.compile(r"`([^`\n]+)`")


def _repository_paths(text: str) -> set[str]:
  text = re.sub(r"```.*?```", "", text, flags=re.S)
  out = set()
  for code in _INLINE.findall(text):
    path = code.strip().split(":")[0].split("::")[0]  # config:variant, test::name
    if (" " in path or any(c in path for c in "<>*{}$=…") or "://" in path
        or not path.startswith(_TOP)):
      continue
    out.add(path.rstrip("/.,;"))
  return out


@pytest.mark.parametrize("page", [p for p in PAGES if not p.endswith("CHANGELOG.md")],
                         ids=lambda p: os.path.relpath(p, ROOT))
def test_every_backticked_repository_path_exists(page):
  # (The changelog is history: it names files that have since moved.)
  with open(page) as f:
    paths = _repository_paths(f.read())
  missing = sorted(p for p in paths if not os.path.exists(os.path.join(ROOT, p)))
  assert not missing, f"{os.path.relpath(page, ROOT)} names paths that do not exist: {missing}"
