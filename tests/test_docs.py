"""README is a short entry point and docs/ holds the rest: the flags reference is the schema's,
the commands README gives are the ones CI runs, and no relative link points nowhere.

No TensorFlow here: these read files, the schema and the absl flag definitions only.
"""

import glob
import os
import re

from absl import flags as absl_flags

from tfpar.config import flags as tfpar_flags
from tfpar.config import schema

from conftest import REPO, load_file

README = os.path.join(REPO, "README.md")
FLAGS_MD = os.path.join(REPO, "docs", "flags.md")
README_MAX_LINES = 200
INSTALL_AND_TRAIN = "pip install -e . && python -m tfpar.train --flagfile=configs/gpt_tiny.flags"
RUN_THE_TESTS = 'pip install -e ".[test]" && python -m pytest -q -n 2 --dist loadfile tests'


def _read(path: str) -> str:
  with open(path, encoding="utf-8") as f:
    return f.read()


def _flags_doc():
  """scripts/flags_doc.py as a module (scripts/ is not a package)."""
  return load_file("scripts", "flags_doc.py")


def _documents():
  return [README] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


def _outside_code(text: str) -> str:
  """Markdown text without its fenced code blocks (a `](` there is no link)."""
  return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _anchors(text: str) -> set:
  """GitHub's heading ids: lower case, punctuation dropped, spaces as '-', repeats numbered."""
  seen, out = {}, set()
  for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", _outside_code(text), flags=re.M):
    slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    out.add(slug if n == 0 else f"{slug}-{n}")
  return out


def _links(text: str):
  return re.findall(r"\]\(([^)\s]+)\)", _outside_code(text))


def test_flags_doc_is_generated_from_todays_schema():
  assert _read(FLAGS_MD) == _flags_doc().render(), (
      "docs/flags.md is stale: run python scripts/flags_doc.py")


def test_every_flag_is_in_the_flags_doc():
  text = _read(FLAGS_MD)
  names = [s.flag for s in schema.settings()]
  assert len(names) > 50, names  # The schema is read, not an empty list.
  for fv in (tfpar_flags.define_plan_flags(absl_flags.FlagValues()),
             tfpar_flags.define_render_flags(absl_flags.FlagValues())):
    names += list(fv)
  missing = [n for n in names if f"`--{n}`" not in text and f"`--[no]{n}`" not in text]
  assert not missing, f"not in docs/flags.md (run python scripts/flags_doc.py): {missing}"


def test_readme_is_an_entry_point_of_at_most_200_lines():
  lines = _read(README).splitlines()
  assert len(lines) <= README_MAX_LINES, (
      f"README.md has {len(lines)} lines: move detail to a docs/ page")


def test_readme_gives_the_two_commands_and_ci_runs_them():
  readme = _read(README)
  assert INSTALL_AND_TRAIN in readme and RUN_THE_TESTS in readme
  ci = _read(os.path.join(REPO, ".ci", "run")).splitlines()
  assert any(re.fullmatch(r'python -m pip install (--quiet )?-e "\.\[test\]"', l) for l in ci), ci
  assert "python -m pytest -q -n 2 --dist loadfile tests" in ci, ci
  assert os.path.exists(os.path.join(REPO, "configs", "gpt_tiny.flags"))


def test_every_relative_link_points_at_a_file_and_heading_that_exist():
  broken = []
  for doc in _documents():
    text = _read(doc)
    for link in _links(text):
      if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
        continue
      path, _, anchor = link.partition("#")
      target = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
      where = f"{os.path.relpath(doc, REPO)}: ({link})"
      if not os.path.exists(target):
        broken.append(f"{where}: no file {os.path.relpath(target, REPO)}")
      elif anchor and target.endswith(".md") and anchor not in _anchors(_read(target)):
        broken.append(f"{where}: no heading #{anchor}")
  assert not broken, "\n".join(broken)


def test_readme_links_every_docs_page():
  linked = {os.path.normpath(os.path.join(REPO, l.partition("#")[0]))
            for l in _links(_read(README)) if l.startswith("docs/")}
  pages = set(glob.glob(os.path.join(REPO, "docs", "*.md")))
  assert not pages - linked, f"docs pages README does not link: {sorted(pages - linked)}"


def _commands(text: str, prefix: str):
  """The shell commands starting with `prefix` in text's code blocks, continuations joined."""
  return [l.strip() for l in text.replace("\\\n", " ").splitlines()
          if l.strip().startswith(prefix)]


def test_readmes_training_commands_give_valid_configs(monkeypatch):
  """Every `python -m tfpar.train` and `tfpar.launch ... --` command README shows is read into a
  validated Config by tfpar.train's own parser (flagfiles relative to the repo, as README runs)."""
  from tfpar.config import config  # pylint: disable=import-outside-toplevel
  monkeypatch.chdir(REPO)
  readme = _read(README)
  argvs = [c.split("&&")[-1].split()[3:] for c in _commands(readme, "pip install -e . &&")]
  argvs += [c.split()[3:] for c in _commands(readme, "python -m tfpar.train ")]
  argvs += [c.split(" -- ", 1)[1].split() for c in _commands(readme, "python -m tfpar.launch ")]
  assert len(argvs) >= 4, argvs
  for argv in argvs:
    cfg = config.from_flags(tfpar_flags.parse(argv))
    assert cfg.train.train_steps > 0, argv
