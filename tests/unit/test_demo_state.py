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


def test_a_workload_file_is_named_as_people_name_it_and_its_compared_prompts_never_ride_in_traffic(tmp_path):
    """The report, the page's marks and the comparison key a file by its records' tag or its stem, and the
    demo splits it by prompt id as the built-ins are (the retrain never trains on what is compared)."""
    from tide.comparison import load_prompts, workload_names

    tagged = tmp_path / "deep" / "prompts.jsonl"
    tagged.parent.mkdir()
    tagged.write_text("".join(f'{{"prompt": "question {i}", "workload": "support"}}\n' for i in range(300)))
    untagged = tmp_path / "legal.jsonl"
    untagged.write_text("".join(f'{{"prompt": "case {i}"}}\n' for i in range(300)))
    assert workload_names("chat", str(tagged)) == ("chat", "support")
    assert workload_names(str(untagged), str(tagged)) == ("legal", "support")
    assert workload_names(str(untagged), str(untagged)) == ("legal-before", "legal-after")
    traffic, compared = load_prompts(str(tagged), "train", None, 12), load_prompts(str(tagged), "heldout", 24, 13)
    assert len(compared) == 24 and not {p.id for p in traffic} & {p.id for p in compared}
    assert len(traffic) + len(load_prompts(str(tagged), "heldout", None, 13)) == 300
    tiny = tmp_path / "tiny.jsonl"  # too small to hold any out: used whole, as before
    tiny.write_text('{"prompt": "a", "id": "x/2"}\n')
    assert [p.id for p in load_prompts(str(tiny), "heldout", 24, 13)] == ["x/2"]
