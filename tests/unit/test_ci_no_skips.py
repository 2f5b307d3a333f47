"""Under CI=true a skip is a failure (tests/conftest.py): checked on a throwaway suite."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def _run(tmp_path, ci: str) -> subprocess.CompletedProcess:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_needs.py").write_text("import pytest\n\ndef test_broker():\n    pytest.skip('no broker')\n")
    (tmp_path / "test_mod.py").write_text("import pytest\npytest.importorskip('no_such_module_xyz')\n\n"
                                          "def test_x():\n    pass\n")
    env = {**os.environ, "CI": ci}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--continue-on-collection-errors", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)


def test_skips_fail_under_ci(tmp_path):
    out = _run(tmp_path, "true")
    assert out.returncode != 0
    assert "skipped under CI=true" in out.stdout and "no broker" in out.stdout
    assert "module skipped under CI=true" in out.stdout


def test_skips_stay_skips_elsewhere(tmp_path):
    out = _run(tmp_path, "")
    assert out.returncode == 0 and "2 skipped" in out.stdout
