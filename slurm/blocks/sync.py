"""Copy the shared blocks (slurm/blocks/*.sh) into the batch scripts that use them.

The batch scripts stay plain files that sbatch and qsub run as they are (both run a copy
of the script, so a script cannot source a file beside it). A block is pasted between two
marker lines, the same in every script that uses it:

    # >>> dmltrain block: activate.sh (edit slurm/blocks/activate.sh, then run sync.py)
    ...
    # <<< dmltrain block: activate.sh

Usage: python slurm/blocks/sync.py [--check]. With --check (the test suite runs it), it
changes nothing, names each script whose copy differs from its block and exits with 1.
"""

import re
import sys
from pathlib import Path

BLOCKS = Path(__file__).resolve().parent
SCRIPTS = BLOCKS.parent
BEGIN = "# >>> dmltrain block: {name} (edit slurm/blocks/{name}, then run sync.py)"
END = "# <<< dmltrain block: {name}"
MARKED = re.compile(
    r"^# >>> dmltrain block: (?P<name>\S+) .*?\n(?P<body>.*?)^# <<< dmltrain block: (?P=name)$",
    re.MULTILINE | re.DOTALL,
)


def scripts() -> list[Path]:
    return sorted(p for p in SCRIPTS.rglob("*.sh") if BLOCKS not in p.parents)


def synced(text: str, where: Path) -> str:
    """``text`` with every marked block replaced by the block's current text."""

    def fill(match: re.Match[str]) -> str:
        name = match["name"]
        block = BLOCKS / name
        if not block.is_file():
            raise SystemExit(f"sync.py: {where} uses block {name}, which is not in {BLOCKS}")
        body = block.read_text()
        return f"{BEGIN.format(name=name)}\n{body}{END.format(name=name)}"

    return MARKED.sub(fill, text)


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print("usage: python slurm/blocks/sync.py [--check]", file=sys.stderr)
        return 2
    stale = []
    for script in scripts():
        text = script.read_text()
        new = synced(text, script)
        if new != text:
            stale.append(script)
            if not check:
                script.write_text(new)
    for script in stale:
        verb = "differs from its blocks" if check else "updated"
        print(f"sync.py: {script.relative_to(SCRIPTS.parent)} {verb}")
    if check and stale:
        print("sync.py: run python slurm/blocks/sync.py to copy the blocks in", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
