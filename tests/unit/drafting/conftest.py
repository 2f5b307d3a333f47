"""The in-process drafter service fixture (tests/unit/drafting/harness.py)."""
import pytest
from harness import Service


@pytest.fixture
def service(tiny_target, agreeing_drafter, tmp_path):
    svc = Service(tiny_target, agreeing_drafter[0], tmp_path)
    yield svc
    svc.stop()
