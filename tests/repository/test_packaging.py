"""The installed layout: passes/ and verify/ ship only as jaggc.passes and jaggc.verify."""

import os
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_package_folder_is_listed_in_pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        cfg = tomllib.load(f)["tool"]["setuptools"]
    listed, dirs = set(cfg["packages"]), cfg["package-dir"]
    found = set()
    for pkg, folder in dirs.items():
        for here, subdirs, files in os.walk(os.path.join(ROOT, folder)):
            subdirs[:] = [d for d in subdirs if d != "__pycache__"]
            if "__init__.py" in files:
                rel = os.path.relpath(here, os.path.join(ROOT, folder))
                found.add(pkg if rel == "." else pkg + "." + rel.replace(os.sep, "."))
    assert found <= listed, f"package folders missing from [tool.setuptools] packages: {sorted(found - listed)}"


def test_imports_from_outside_the_repo_and_no_generic_top_level_modules():
    code = (
        "import importlib.util, jaggc, jaggc.passes, jaggc.verify, jaggc.frontends.fx;"
        "assert importlib.util.find_spec('passes') is None, 'a top-level passes module is installed';"
        "assert importlib.util.find_spec('verify') is None, 'a top-level verify module is installed';"
        "assert jaggc.passes.run_passes and jaggc.verify.__name__ == 'jaggc.verify';"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "jaggc.cli", "--help"], cwd="/", capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "example" in out.stdout and "inspect" in out.stdout
