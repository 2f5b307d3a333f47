"""The ops tests share the engine fakes of tests/unit/engine (fake_engine.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
