"""The top-level schemas/ and dashboards/ are the one copy in git, packaged as tide.schemas and
tide.dashboards (pyproject.toml package-dir) and read from the package.

pyproject.toml lists every package under tide/ (setuptools' own discovery, so a new subpackage
cannot be left out of the wheel) and maps the two folders; its package-data takes every file in
them; each Dockerfile that builds the wheel copies them into its context. Code reads the packaged
copy (importlib.resources), which in this checkout's editable install is the top-level folder
itself. The built wheel carrying them is tests/e2e/test_wheel.py's.
"""
from __future__ import annotations

import fnmatch
import re
import tomllib
from importlib import resources
from pathlib import Path

from setuptools.discovery import PEP420PackageFinder

import tide.prometheus

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
MAPPED = {"tide.schemas": "schemas", "tide.dashboards": "dashboards"}


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.suffix != ".pyc"}


def test_pyproject_packages_every_package_and_maps_the_top_level_folders():
    assert PYPROJECT["package-dir"] == MAPPED
    found = set(PEP420PackageFinder.find(str(ROOT), include=["tide*"]))
    assert set(PYPROJECT["packages"]) == found | set(MAPPED), "pyproject.toml's packages list is stale"
    for package, folder in MAPPED.items():
        patterns = PYPROJECT["package-data"][package]
        data = [n for n in _files(ROOT / folder) if not n.endswith(".py")]
        assert data and all(any(fnmatch.fnmatch(n, p) for p in patterns) for n in data), (package, data)
    # the old copies are gone: one copy in git
    assert not [p for p in (ROOT / "tide" / "assets").rglob("*") if p.is_file() and p.suffix == ".json"
                and p.parent.name in ("schemas", "dashboards")]


def test_the_code_reads_the_packaged_copy():
    for package, folder in MAPPED.items():
        packaged = resources.files(package)
        assert {p.name: p.read_bytes() for p in packaged.iterdir() if p.is_file() and not p.name.endswith(".pyc")} \
            == _files(ROOT / folder), package
    rules = resources.files("tide.dashboards").joinpath("prometheus-rules.yml")
    assert Path(tide.prometheus.RULES_PATH) == Path(str(rules)) and tide.prometheus.RULES_PATH.is_file()
    assert str(tide.prometheus.RULES_PATH) in tide.prometheus.scrape_config({"engine": "127.0.0.1:1"})["rule_files"]


def test_every_image_build_copies_the_packaged_folders():
    for dockerfile in ("k8s/Dockerfile", "k8s/Dockerfile.sglang"):
        text = (ROOT / dockerfile).read_text()
        assert re.search(r"^COPY pyproject\.toml ", text, re.M), dockerfile
        for folder in MAPPED.values():
            assert re.search(rf"^COPY {folder} \./{folder}$", text, re.M), (dockerfile, folder)
