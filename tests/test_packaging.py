"""What an install takes of the checkout (setup.cfg's ``packages``): every folder of the
library is a package that git keeps and that setup.cfg names, so a clone installs all of
it; the bundled experiments install as ``dmltrain_experiments``."""

import configparser
import subprocess

from helpers import ROOT
from setuptools import find_packages


def test_every_folder_of_the_library_is_a_package_an_install_takes():
    folders = {
        path.parent.relative_to(ROOT).as_posix().replace("/", ".")
        for path in (ROOT / "dmltrain").rglob("*.py")
        if "__pycache__" not in path.parts
    }
    found = set(find_packages(str(ROOT), include=["dmltrain", "dmltrain.*"]))
    assert folders == found  # a folder without __init__.py would be left out
    inits = [f"{name.replace('.', '/')}/__init__.py" for name in sorted(found)]
    tracked = subprocess.run(["git", "ls-files", *inits], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()  # fmt: skip
    assert sorted(tracked) == sorted(inits)  # none hidden by .gitignore (data/ once was)
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    listed = set(setup["options"]["packages"].split())
    assert listed == found | {"dmltrain_experiments"}  # a new subpackage must be listed
    assert "dmltrain_experiments = experiments" in setup["options"]["package_dir"]
