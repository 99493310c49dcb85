"""The pages under docs/ say only what runs: every dmltrain command line on a page parses as
the command would parse it (``--print-config``; ``submit`` writes its script with
``--dry-run``), every flag a page names exists, and every YAML block loads as ``--config``."""

import re
import shlex
import sys

import pytest
from helpers import ROOT, readme_experiment

from dmltrain import cli

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
SPAN = re.compile(r"`([^`\n]+)`")
YAML = re.compile(r"```yaml\n(.*?)```", re.S)


def command_lines(text: str) -> list[list[str]]:
    """The dmltrain arguments of each code span that runs dmltrain: ``dmltrain ARGS``,
    a batch script of slurm/ with ARGS, or ``DMLTRAIN_ARGS="ARGS"``."""
    found = []
    for span in SPAN.findall(text):
        try:
            words = shlex.split(span)
        except ValueError:
            continue  # not a command line (Python, a fragment)
        given = [w.split("=", 1)[1] for w in words if w.startswith("DMLTRAIN_ARGS=")]
        scripts = [i for i, w in enumerate(words) if w.startswith("slurm/") and w.endswith(".sh")]
        if given:
            found.append(shlex.split(given[0]))
        elif "dmltrain" in words[:-1]:  # the bare word is the command's name in a sentence
            found.append(words[words.index("dmltrain") + 1 :])
        elif scripts:
            found.append(words[scripts[0] + 1 :])
    return found


@pytest.fixture
def line(tmp_path, monkeypatch):
    """The README's experiment as my_experiment.py in the current directory (imported
    afresh: another test's my_experiment.py may be loaded already)."""
    readme_experiment(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_experiment", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return cli.experiment_file(tmp_path / "my_experiment.py")


def flag_names(line: cli.Experiment) -> set[str]:
    """Every flag of an experiment's command (mnist's, and the README experiment's own
    options) and of ``dmltrain submit``."""
    names: set[str] = set()
    experiments = {**cli.discover_experiments(), "line": line}
    parser = cli.build_parser(experiments)
    commands = next(a for a in parser._actions if hasattr(a, "choices") and a.choices)
    for name in ("mnist", "line", "submit"):
        for action in commands.choices[name]._actions:
            names.update(s for s in action.option_strings if s.startswith("--"))
    return names


def test_there_are_pages_and_they_run_dmltrain():
    assert PAGES and all(command_lines(page.read_text()) for page in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_command_line_of_a_page_parses(page, line, tmp_path, capsys):
    text = page.read_text()
    for block in YAML.findall(text):  # the page's config file, as its commands name it
        (tmp_path / "my_experiment.yml").write_text(block)
        assert (
            cli.main(["my_experiment.py", "--config", "my_experiment.yml", "--print-config"]) == 0
        )
    for args in command_lines(text):
        extra = ["--dry-run"] if args[:1] == ["submit"] else ["--print-config"]
        status = cli.main([*args, *extra])
        assert status == 0, f"{page.name}: dmltrain {shlex.join(args)}: {capsys.readouterr().err}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_flag_a_page_names_exists(page, line):
    known = flag_names(line)
    named = {
        word.split("=", 1)[0]
        for span in SPAN.findall(page.read_text())
        if span.startswith("--")
        for word in span.split()
        if word.startswith("--")
    }
    assert named and not named - known, f"{page.name} names unknown flags: {named - known}"
