"""Target checkpoint folders: validation of operator folders, cache-hit rule, failed conversions."""
import json
import shutil
import time

import pytest

from tide.models.checkpoint import (
    CONVERSION_FORMAT,
    CONVERSION_RECORD,
    SMOLLM2_CACHE_NAME,
    CheckpointError,
    convert_gguf_checkpoint,
    ensure_target_checkpoint,
    smollm2_gguf_path,
    validate_checkpoint_folder,
)
from tide.models.tiny import tiny_llama_checkpoint


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDE_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def copy_of(folder, dest):
    shutil.copytree(folder, dest)
    return dest


def test_a_folder_target_is_validated_and_returned_as_is(tmp_path, tiny_folder):
    home = tmp_path / "home"
    assert ensure_target_checkpoint(home, str(tiny_folder)) == tiny_folder
    assert not (home / "models").exists()  # nothing converted or cached


def test_missing_folder_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="neither 'smollm2' nor an existing folder"):
        ensure_target_checkpoint(tmp_path, str(tmp_path / "nope"))


def test_missing_or_bad_config_is_refused(tmp_path, tiny_folder):
    folder = copy_of(tiny_folder, tmp_path / "m")
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        validate_checkpoint_folder(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        validate_checkpoint_folder(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="'gpt2' is not supported"):
        validate_checkpoint_folder(folder)


def test_pickle_weights_are_refused_with_a_clear_error(tmp_path, tiny_folder):
    folder = copy_of(tiny_folder, tmp_path / "p")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pickle weights \['pytorch_model.bin'\].*safetensors"):
        validate_checkpoint_folder(folder)
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        validate_checkpoint_folder(folder)


def test_a_current_conversion_record_makes_a_cache_hit(tmp_path, tiny_folder):
    """The cache rule: complete folder + record naming this GGUF, its size and the format."""
    home = tmp_path / "home"
    gguf = smollm2_gguf_path()
    cached = copy_of(tiny_folder, home / "models" / SMOLLM2_CACHE_NAME)
    (cached / CONVERSION_RECORD).write_text(json.dumps(
        {"format": CONVERSION_FORMAT, "source_name": gguf.name, "source_bytes": gguf.stat().st_size}))
    started = time.monotonic()
    assert ensure_target_checkpoint(home, progress=False) == cached
    assert time.monotonic() - started < 1.0


def test_a_failed_conversion_leaves_nothing_behind(tmp_path):
    bogus = tmp_path / "broken.gguf"
    bogus.write_bytes(b"GGUF" + b"\x00" * 64)  # right magic, nonsense header
    dest = tmp_path / "out" / "converted"
    with pytest.raises(CheckpointError, match="broken.gguf"):
        convert_gguf_checkpoint(bogus, dest, progress=False)
    assert not dest.exists()
    assert list((tmp_path / "out").iterdir()) == []  # the temporary folder was removed too


def test_a_failed_reconversion_keeps_the_previous_folder(tmp_path, tiny_folder):
    dest = copy_of(tiny_folder, tmp_path / "out" / "converted")
    bogus = tmp_path / "broken.gguf"
    bogus.write_bytes(b"not a gguf at all")
    with pytest.raises(CheckpointError):
        convert_gguf_checkpoint(bogus, dest, progress=False)
    assert validate_checkpoint_folder(dest) == dest
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["converted"]
