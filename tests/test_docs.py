"""README.md and docs/ say only what runs: every dmltrain command line they show parses as
the command would parse it (``--print-config``; ``submit`` and ``sweep`` write their
scripts with ``--dry-run``), every flag a page names exists, every YAML block loads as
``--config``, every Python example is one that tests/test_readme.py runs, the generated
reference is in sync with the code, every link between pages resolves, and no sentence of
prose runs past 40 words."""

import json
import re
import shlex
import statistics
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, readme_experiment, run_cli

from dmltrain import cli
from dmltrain.hooks import TrainerHooks
from dmltrain.records.rundir import FILES

DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
IDS = [page.name for page in PAGES]
SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
HEREDOC = re.compile(r"cat > (\S+) <<'EOF'\n(.*?)\nEOF", re.S)
SAVED = re.compile(r"Save this as `(\w+\.py)`:\n\n```python\n(.*?)\n```", re.S)  # a page's file
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]+(\.py)?")  # EXPERIMENT, RUN_DIR, FILE.py
# The batch systems' own flags, which the pages name beside dmltrain's.
BATCH_FLAGS = {"--nodes", "--ntasks-per-node", "--gpus-per-task", "--gpus-per-node", "--ppn",
               "--cpus-per-task", "--signal", "--open-mode", "--requeue", "--exclusive",
               "--dependency", "--array", "--mpi", "--partition"}  # fmt: skip

# Every Python block of the pages: the test that runs it (tests/test_readme.py).
EXAMPLES = {
    ("README.md", "## A complete experiment"): "helpers.readme_experiment, in every test of it",
    ("experiments.md", "## Metrics over the whole validation set, and images"):
        "test_the_metrics_example_logs_the_whole_sets_rmse_and_a_figure",
    ("extending.md", "## Callbacks"): "test_the_callback_example_logs_and_checkpoints_its_state",
    ("extending.md", "## Several models and optimizers (a GAN)"):
        "test_the_manual_step_shown_is_the_bundled_gans",
    ("extending.md", "## A tracker of your own"):
        "test_the_tracker_example_is_named_by_its_entry_point",
    ("launching.md", "## From a notebook to a cluster"):
        "test_the_notebook_example_trains_on_two_processes",
    ("climate-data.md", "## An archive to try it on"):
        "data/test_zarr_windows.py::test_the_forecast_example_preempted_on_2_ranks_x_2_workers_resumes_bitwise",
    ("climate-data.md", "## A forecast model"):
        "data/test_zarr_windows.py::test_the_forecast_example_preempted_on_2_ranks_x_2_workers_resumes_bitwise",
    ("large-models.md", "## Activation checkpointing"):
        "test_the_large_model_example_trains_in_pairs_of_shards_recomputed",
}  # fmt: skip


def command_lines(text: str) -> list[list[str]]:
    """The dmltrain arguments of each command a page shows, in its shell blocks and its
    code spans: ``dmltrain ARGS``, ``python FILE.py [NAME] ARGS``, a batch script of slurm/
    with ARGS, ``DMLTRAIN_ARGS="ARGS"``."""
    found = []
    shell = [body for lang, body in FENCE.findall(text) if lang in ("bash", "sh", "")]
    snippets = [line for body in shell for line in body.replace("\\\n", " ").splitlines()]
    for snippet in snippets + SPAN.findall(text):
        for part in snippet.split("&&"):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:
                continue  # not a command line (Python, a fragment)
            args = _dmltrain_args(words)
            if args:
                found.append(args)
    return found


def _dmltrain_args(words: list[str]) -> list[str] | None:
    if any(w == "..." or PLACEHOLDER.fullmatch(w) for w in words):
        return None  # a pattern (dmltrain submit pbs ..., dmltrain EXPERIMENT --help)
    given = [w.split("=", 1)[1] for w in words if w.startswith("DMLTRAIN_ARGS=")]
    if given:
        return shlex.split(given[0])
    if "dmltrain" in words[:-1]:  # the bare word is the command's name in a sentence
        return words[words.index("dmltrain") + 1 :]
    if words[:2] == ["python", "my_experiment.py"]:  # the README's file: [NAME] ARGS
        named = len(words) > 2 and not words[2].startswith("-")
        return [words[1], *words[3 if named else 2 :]]
    scripts = [i for i, w in enumerate(words) if w.startswith("slurm/") and w.endswith(".sh")]
    if scripts:
        args = words[scripts[0] + 1 :]
        return args[1:] if words[scripts[0]].endswith("chain.sh") else args  # JOBS first
    return None


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A folder with the README's experiment as my_experiment.py, the current directory
    (imported afresh: another test's my_experiment.py may be loaded already)."""
    readme_experiment(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_experiment", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return tmp_path


def check_command(args: list[str], known: dict) -> None:
    """Parse ``dmltrain ARGS`` as the command would, writing nothing but --dry-run scripts."""
    if args[0] in cli.TOOLS and len(args) < {"submit": 3}.get(args[0], 2):
        return  # it names the tool in a sentence (dmltrain plot, dmltrain submit pbs)
    if args[0] in ("submit", "sweep") and args[1] not in ("status", "task"):
        assert cli.main([*args, "--dry-run"]) == 0
    elif args[0] in cli.TOOLS:
        parse = cli.build_parser(known).parse_known_args if args[0] == "sweep" else None
        (parse or cli.build_parser(known).parse_args)(args)  # exits 2 on a bad argument
    else:
        assert cli.main([*args, "--print-config"]) == 0


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_command_line_of_a_page_parses(page, here, capsys):
    text = page.read_text()
    for name, body in HEREDOC.findall(text) + SAVED.findall(text):  # files its commands use
        (here / name).write_text(body + "\n")
    for lang, body in FENCE.findall(text):  # the page's config file, as its commands name it
        if lang == "yaml" and "cat >" not in body:
            (here / "my_experiment.yml").write_text(body)
            assert cli.main(["my_experiment.py", "--config", "my_experiment.yml",
                             "--print-config"]) == 0  # fmt: skip
    known = {**cli.discover_experiments(), "line": cli.experiment_file(here / "my_experiment.py")}
    for args in command_lines(text):
        try:
            check_command(args, known)
        except (AssertionError, SystemExit) as exc:
            raise AssertionError(
                f"{page.name}: dmltrain {shlex.join(args)}: {capsys.readouterr().err}"
            ) from exc


def flag_names(line: cli.Experiment) -> set[str]:
    """Every flag of an experiment's command (the bundled ones', and the README
    experiment's own options) and of the tools."""
    parser = cli.build_parser({**cli.discover_experiments(), "line": line})
    commands = next(a for a in parser._actions if hasattr(a, "choices") and a.choices)
    return {
        string
        for name in ("mnist", "mnist-gan", "forecast", "line", *cli.TOOLS)
        for action in commands.choices[name]._actions
        for string in action.option_strings
        if string.startswith("--")
    }


def test_every_flag_the_pages_name_exists(here):
    known = flag_names(cli.experiment_file(here / "my_experiment.py")) | BATCH_FLAGS
    for page in PAGES:
        named = {
            word.split("=", 1)[0].rstrip(",")
            for span in SPAN.findall(page.read_text())
            for word in span.split()
            if span.startswith("--") and word.startswith("--") and "*" not in word
        } - {"--x", "--no-x"}  # the reference's example of a pair
        assert not named - known, f"{page.name} names flags that do not exist: {named - known}"


def test_every_python_example_is_run_by_a_test():
    shown = set()
    for page in PAGES:
        heading = ""
        for line_or_block in re.split(r"(```\w*\n.*?```)", page.read_text(), flags=re.S):
            if line_or_block.startswith("```python"):
                shown.add((page.name, heading))
            else:
                headings = re.findall(r"^(#{2,3} .+)$", line_or_block, re.M)
                heading = headings[-1] if headings else heading
    assert shown == set(EXAMPLES), shown ^ set(EXAMPLES)
    tests = (ROOT / "tests" / "test_readme.py").read_text()
    for runner in EXAMPLES.values():
        if "::" in runner:  # a test beside the module it proves
            path, runner = runner.split("::")
            assert f"def {runner}(" in (ROOT / "tests" / path).read_text(), runner
        else:
            assert runner.startswith("helpers.") or f"def {runner}(" in tests, runner


def test_the_reference_is_written_from_the_code():
    done = subprocess.run([sys.executable, str(DOCS / "make_reference.py"), "--check"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_the_reference_names_every_variable_of_the_batch_scripts():
    sys.path.insert(0, str(DOCS))
    try:
        from make_reference import ENVIRONMENT
    finally:
        sys.path.remove(str(DOCS))
    scripts = [*(ROOT / "slurm").rglob("*.sh"), *(ROOT / "environment").glob("*.sh")]
    used = {name for path in scripts for name in re.findall(r"DMLTRAIN_[A-Z_]+", path.read_text())}
    assert used == set(ENVIRONMENT)


def test_the_reference_names_every_entry_of_a_run_directory(tmp_path):
    run = tmp_path / "run"
    done = run_cli("tiny", "--epochs", "1", "--nprocs", "2", "--tracker", "tensorboard",
                   "--run-dir", str(run), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    entries = {p.name + ("/" if p.is_dir() else "") for p in run.iterdir()}
    assert entries <= set(FILES), entries - set(FILES)
    # (ranks.csv is written only in a log interval where one rank was slow)
    assert {"config.yaml", "outcome.json", "checkpoints/", "tensorboard/"} <= entries


def test_the_methods_table_names_every_method_a_subclass_may_write():
    table = (DOCS / "experiments.md").read_text().split("## What a subclass writes", 1)[1]
    table = table.split("\n## ", 1)[0]
    hooks = [n for n in vars(TrainerHooks) if not n.startswith("_") and n not in ("config",)]
    missing = [name for name in hooks if f"`{name}" not in table]
    assert not missing, missing


def test_every_test_the_guarantees_cite_exists():
    guarantees = (DOCS / "guarantees.md").read_text()
    cited = re.findall(r"`(tests/(?:\w+/)?test_\w+\.py)::(test_\w+)`", guarantees)
    assert len(cited) > 20
    for path, name in cited:
        assert f"def {name}(" in (ROOT / path).read_text(), f"{path}::{name}"


def test_every_link_between_pages_resolves():
    def anchors(text: str) -> set[str]:
        titles = re.findall(r"^#+ (.+)$", text, re.M)
        return {re.sub(r"[^\w\- ]", "", t.lower()).replace(" ", "-") for t in titles}

    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name}: {target}"
            if anchor and linked.suffix == ".md":
                assert anchor in anchors(linked.read_text()), f"{page.name}: {target}"


def test_the_search_of_sweeps_md_runs_here_and_its_status_and_plots_follow(tmp_path):
    """docs/sweeps.md's search with pruning, run for real on this machine at a smaller
    size (3 trials of 1 epoch of the bundled digits, --local for the array), then its
    status and plot lines as the page shows them."""
    text = (DOCS / "sweeps.md").read_text()
    block = text.split("## Searches that stop bad trials early")[1]
    (name, body), *_ = HEREDOC.findall(block)
    (tmp_path / name).write_text(body + "\n")
    lines = command_lines("```bash\n" + FENCE.findall(block)[0][1] + "```")
    sweep, status, plot = (args for args in lines if args[0] in ("sweep", "plot"))
    smaller = {"--epochs": "1", "--val-every-steps": "20", "--trials": "3"}
    args = [
        smaller.get(before, word) for before, word in zip(["", *sweep[:-1]], sweep, strict=True)
    ]
    args = [*args[: args.index("--max-parallel")], "--local", "--no-download"]
    done = run_cli(*args, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("(exit status 0)") == 3, done.stdout
    shown = run_cli(*status, cwd=tmp_path)
    assert shown.returncode == 0 and "dmltrain sweep: best trial" in shown.stdout, shown.stdout
    drawn = run_cli(*plot, cwd=tmp_path)
    assert drawn.returncode == 0 and "search_history.png" in drawn.stdout, drawn.stderr


def test_the_fine_tuning_page_runs_here_as_written(tmp_path):
    """docs/fine-tuning.md's commands in order, on the bundled digits (20 steps a run): a
    new head on frozen convolutions, a slower backbone, LoRA and its merged export, and
    that export loaded back as safetensors."""
    from dmltrain.checkpoint.storage import load_file

    text = (DOCS / "fine-tuning.md").read_text()
    blocks = [body for lang, body in FENCE.findall(text) if lang == "bash"]
    lines = [args for body in blocks for args in command_lines(f"```bash\n{body}```")]
    assert [args[0] for args in lines] == ["mnist", "mnist", "mnist", "mnist", "export", "mnist"]
    for args in lines:
        # a smaller size: 20 steps of each run, not an epoch
        extra = ["--no-download", "--progress", "off", "--max-steps", "20"]
        extra = extra if args[0] == "mnist" else []
        done = run_cli(*args, *extra, cwd=tmp_path, timeout=600)
        assert done.returncode == 0, (args, done.stderr[-3000:])
    runs = tmp_path / "runs"
    before = load_file(runs / "pretrained" / "checkpoints" / "latest.pt")["model"]
    five = load_file(runs / "five" / "checkpoints" / "latest.pt")["model"]
    assert all(torch.equal(before[k], five[k]) for k in before if k.startswith("conv"))
    assert five["fc2.weight"].shape == (5, 128)
    lora = load_file(runs / "lora" / "checkpoints" / "latest.pt")["model"]
    assert sorted(lora) == [f"fc{i}.lora_{x}.default.weight" for i in (1, 2) for x in "AB"]
    report = json.loads((runs / "from-safetensors" / "load_report.json").read_text())
    assert report["kind"] == "safetensors" and len(report["loaded"]) == 8


LONGEST = 40  # words in a sentence of prose; a list or a table may say more
LIST_ITEM = re.compile(r"^\s*([-*+]|\d+\.)\s")
# after . ! ? (not e.g., i.e., etc., vs.), or after a colon before a capital
SENTENCE_END = re.compile(
    r"(?<!e\.g\.)(?<!i\.e\.)(?<!etc\.)(?<!vs\.)(?<=[.!?])\s+|(?<=:)\s+(?=[A-Z(\"])"
)


def prose_sentences(text: str) -> list[str]:
    """The sentences of a page's paragraphs: code blocks, headings, tables and list items
    left out; a code span counts as one word, a link as its text."""
    text = re.sub(r"^```.*?^```", "\n", text, flags=re.S | re.M)
    paragraphs, lines, in_list = [], [], False
    for line in [*text.splitlines(), ""]:
        skip = line.lstrip().startswith(("#", "|", "<!--")) or LIST_ITEM.match(line)
        if not line.strip() or skip or (in_list and line.startswith((" ", "\t"))):
            paragraphs += [" ".join(lines)] if lines else []
            lines = []
            in_list = bool(LIST_ITEM.match(line)) or (in_list and bool(line.strip()))
            continue
        in_list = False
        lines.append(line.strip())
    sentences = []
    for paragraph in paragraphs:
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", re.sub(r"`[^`]*`", "CODE", paragraph))
        sentences += [s for s in SENTENCE_END.split(plain) if s.split()]
    return sentences


def test_no_sentence_of_prose_runs_past_40_words(capsys):
    """Reports each page's sentence lengths (pytest -s shows them); fails on a sentence of
    prose over LONGEST words, naming its page and its start."""
    too_long = []
    with capsys.disabled():
        print("\npage                 sentences  median  longest")
    for page in PAGES:
        lengths = [(len(s.split()), s) for s in prose_sentences(page.read_text())]
        if not lengths:
            continue
        longest = max(n for n, _ in lengths)
        with capsys.disabled():
            median = statistics.median(n for n, _ in lengths)
            print(f"{page.name:20} {len(lengths):9}  {median:6}  {longest:7}")
        too_long += [f"{page.name} ({n} words): {s[:80]}..." for n, s in lengths if n > LONGEST]
    assert not too_long, "split these sentences:\n" + "\n".join(too_long)


def test_the_sentence_counter_sees_prose_only():
    text = (
        "One two three. Four `a b c` five [six seven](x.md)!\n\n"
        "| a | table row |\n\n- a list item\n  that goes on\n\n```bash\ncode here\n```\n"
        "# A heading\nLast one."
    )
    assert [len(s.split()) for s in prose_sentences(text)] == [3, 5, 2]
