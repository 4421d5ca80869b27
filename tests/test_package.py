"""The published package: its metadata, and a wheel that installs and runs away from the source.

``python -m build`` makes an sdist and a wheel from a copy of the project's files; a fresh venv
(``--system-site-packages``: TensorFlow and Keras come from this interpreter, nothing is
downloaded for them) installs the wheel alone and runs ``tfmx.enable()`` and a recipe at
``--quick`` from the installed files, not from this checkout. About a minute on two cores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tfmx", "fusion", "policies", "recipes")
TOP_FILES = ("pyproject.toml", "PYPI.md", "README.md", "LICENSE", "CHANGELOG.md")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_metadata_names_the_distribution_version_and_license():
    project = _pyproject()["project"]
    assert project["name"] == "tfmx-keras"
    assert project["version"] == "0.2.0"
    assert project["license"] == "Apache-2.0"
    assert project["scripts"] == {"tfmx": "tfmx.cli:main"}
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert "## 0.2.0" in (ROOT / "CHANGELOG.md").read_text()
    assert "urls" not in project  # none is real yet: no homepage, no public repository


def test_dependency_bounds_are_the_tested_releases():
    project = _pyproject()["project"]
    deps = project["dependencies"]
    linux = [d for d in deps if d.startswith("tensorflow") and "!= 'darwin'" in d]
    apple = [d for d in deps if d.startswith("tensorflow") and "== 'arm64'" in d]
    assert linux == ["tensorflow>=2.21,<2.22; sys_platform != 'darwin' or "
                     "platform_machine != 'arm64'"]
    assert len(apple) == 1 and "<2.20" not in apple[0]  # the open plugin loads into 2.21
    assert "keras>=3.15,<3.16" in deps
    metal = project["optional-dependencies"]["metal"]
    assert any(d.startswith("tensorflow-metal==1.2.0") for d in metal)
    assert any(d.startswith("tensorflow>=2.18,<2.20") for d in metal)
    assert any(d.startswith("mkdocs") for d in project["optional-dependencies"]["docs"])
    assert any(d.startswith("build") for d in project["optional-dependencies"]["test"])
    tested = (ROOT / "CHANGELOG.md").read_text()
    assert "| TensorFlow | 2.21.0 | >=2.21,<2.22" in tested and "Intel Macs" in tested


def test_pypi_description_has_no_relative_link():
    text = (ROOT / _pyproject()["project"]["readme"]["file"]).read_text()
    links = [part.split(")", 1)[0] for part in text.split("](")[1:]]
    assert all(link.startswith("https://") for link in links), links


def _copy_sources(dest: Path) -> None:
    """The files a build reads, copied: the build's egg-info and build/ stay out of the
    checkout."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, dest / package, ignore=ignore)
    for name in TOP_FILES:
        shutil.copy2(ROOT / name, dest / name)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_wheel_installs_in_a_fresh_venv_and_runs_a_recipe(tmp_path):
    pytest.importorskip("build")
    src, dist, home = tmp_path / "src", tmp_path / "dist", tmp_path / "home"
    src.mkdir()
    home.mkdir()
    _copy_sources(src)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", TFMX_RECIPES_OFFLINE="1", HOME=str(home),
               KERAS_HOME=str(home / ".keras"), TFMX_VERBOSE="0")
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(src)], src, env, 300)
    wheels = list(dist.glob("tfmx_keras-0.2.0-*.whl"))
    assert len(wheels) == 1 and len(list(dist.glob("tfmx_keras-0.2.0.tar.gz"))) == 1
    names = zipfile.ZipFile(wheels[0]).namelist()
    for package in PACKAGES:
        assert f"{package}/__init__.py" in names
    tops = {n.split("/")[0] for n in names if "/" in n and ".dist-info" not in n}
    assert tops == set(PACKAGES), tops  # the benchmark stays in the repository
    assert "recipes/small_cnn.py" in names and "recipes/_runner.py" in names
    assert "tfmx/data/tensorflow-metal-plugin-0.4.1.json" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)
    meta = zipfile.ZipFile(wheels[0]).read("tfmx_keras-0.2.0.dist-info/METADATA").decode()
    assert "Name: tfmx-keras" in meta and "License-Expression: Apache-2.0" in meta
    assert "Description-Content-Type: text/markdown" in meta and "Project-URL" not in meta
    assert "# tfmx-keras" in meta  # the PyPI page's text

    venv.create(tmp_path / "venv", system_site_packages=True, with_pip=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    _run([python, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-index",
          str(wheels[0])], tmp_path, env, 300)
    where = _run([python, "-c", "import tfmx, recipes; tfmx.enable(); "
                  "print(tfmx.__file__); print(recipes.__file__); print(tfmx.enabled())"],
                 tmp_path, env, 300).split()
    venv_dir = str(tmp_path / "venv")
    assert all(path.startswith(venv_dir) for path in where[:2]), where
    assert where[2] == "True"
    entry = (tmp_path / "venv" / "bin" / "tfmx")
    assert entry.exists()
    listing = _run([str(entry), "recipe", "--list"], tmp_path, env, 300)
    assert "small_cnn" in listing
    away = subprocess.run([str(entry), "bench", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert away.returncode != 0 and "clone of tfmx's repository" in away.stderr
    out = tmp_path / "run"
    _run([python, "-m", "recipes.small_cnn", "--quick", "--tfmx-only", "--out", str(out)],
         tmp_path, env, 600)
    assert (out / "metrics.json").exists()
