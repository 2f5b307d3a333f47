"""``tide demo`` starts over every run: a previous run's state is gone, the home's caches are kept."""
from tide.demo import SHARED_CACHES, fresh_state


def test_a_demo_runs_on_fresh_state_with_the_home_caches_linked(tmp_path):
    home = tmp_path / "home"
    (home / "models" / "smollm2").mkdir(parents=True)
    (home / "models" / "smollm2" / "model.safetensors").write_bytes(b"weights")
    (home / "mlflow").mkdir()  # a `tide up` of the same home: not the demo's to touch
    (home / "mlflow" / "mlflow.db").write_bytes(b"registry")
    state = fresh_state(home)
    assert state == home / "demo"
    for name in SHARED_CACHES:
        assert (state / name).is_symlink() and (state / name).resolve() == (home / name).resolve()
    assert (state / "models" / "smollm2" / "model.safetensors").read_bytes() == b"weights"
    # a run leaves a registry with an adapted champion, data and a marks file ...
    (state / "mlflow").mkdir()
    (state / "mlflow" / "mlflow.db").write_bytes(b"champion v2")
    (state / "dataset" / "part").mkdir(parents=True)
    (state / "kernels" / "rows.so").write_bytes(b"kernel")  # written through the link: a cache
    # ... and the next run sees none of its state, and every cache
    state = fresh_state(home)
    assert sorted(p.name for p in state.iterdir()) == sorted(SHARED_CACHES)
    assert (home / "kernels" / "rows.so").read_bytes() == b"kernel"
    assert (home / "models" / "smollm2" / "model.safetensors").read_bytes() == b"weights"
    assert (home / "mlflow" / "mlflow.db").read_bytes() == b"registry"
