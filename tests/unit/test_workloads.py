"""Workload loaders: real data wheels, deterministic splits, ShareGPT recovery, operator JSONL files."""
import json
import time

import pytest

from tide.workloads import (
    Prompt,
    WorkloadError,
    code,
    korean,
    load_jsonl_workload,
    load_workload,
    select,
    sharegpt,
    split_of,
    workload_name,
    write_jsonl_workload,
)
from tide.workloads.sharegpt import first_turn_pairs, hangul_ratio, is_english, iter_records, looks_like_code


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("tide-home")


@pytest.fixture(autouse=True)
def _isolated_home(home, monkeypatch):
    monkeypatch.setenv("TIDE_HOME", str(home))


def ids(prompts):
    return [p.id for p in prompts]


def text(p: Prompt) -> str:
    return p.chat_messages()[-1]["content"]


# --- split and selection -------------------------------------------------------------------

def test_split_is_a_stable_tenth_of_the_ids():
    sample = [f"w/{i}" for i in range(20000)]
    held = sum(split_of(i) == "heldout" for i in sample)
    assert 1800 < held < 2200  # 10 % ± ~4.7 sigma
    assert [split_of(i) for i in sample[:50]] == [split_of(i) for i in sample[:50]]


def test_select_is_seeded_disjoint_and_prefix_stable():
    prompts = [Prompt(id=f"x/{i}", workload="t", prompt=f"p{i}") for i in range(500)]
    train, held = select(prompts, "train", None, 0), select(prompts, "heldout", None, 0)
    assert len(train) + len(held) == 500 and not set(ids(train)) & set(ids(held))
    assert ids(select(prompts, "train", 10, 3)) == ids(select(prompts, "train", 10, 3))
    assert ids(select(prompts, "train", 10, 3)) != ids(select(prompts, "train", 10, 4))
    assert ids(select(prompts, "train", 20, 3))[:10] == ids(select(prompts, "train", 10, 3))
    with pytest.raises(WorkloadError, match="split"):
        select(prompts, "test", 1, 0)
    with pytest.raises(WorkloadError, match="n must be"):
        select(prompts, "train", -1, 0)


def test_prompt_needs_exactly_one_of_messages_or_prompt():
    with pytest.raises(WorkloadError):
        Prompt(id="a", workload="w")
    with pytest.raises(WorkloadError):
        Prompt(id="a", workload="w", prompt="x", messages=[{"role": "user", "content": "x"}])
    assert Prompt(id="a", workload="w", prompt="hi").chat_messages() == [{"role": "user", "content": "hi"}]


# --- ShareGPT ------------------------------------------------------------------------------

def test_truncated_json_array_yields_the_complete_records():
    data = '[\n {"id": "a", "n": [1, 2]},\n {"id": "b"} , {"id": "c", "conversations": [{"from": "hu'
    assert [r["id"] for r in iter_records(data)] == ["a", "b"]
    assert [r["id"] for r in iter_records('[{"id": "a"}, {"id": "b"}]')] == ["a", "b"]


def test_first_turn_pairs_need_human_then_assistant():
    records = [
        {"id": "h", "conversations": [{"from": "human", "value": "Hi there Share Prompt"},
                                      {"from": "gpt", "value": "Hello!"}]},
        {"id": "g", "conversations": [{"from": "gpt", "value": "continuation"},
                                      {"from": "human", "value": "more"}]},
        {"id": "e", "conversations": [{"from": "human", "value": "   "}, {"from": "gpt", "value": "x"}]},
        {"id": "s", "conversations": [{"from": "human", "value": "alone"}]},
    ]
    assert list(first_turn_pairs(iter(records))) == [{"id": "h", "prompt": "Hi there", "reference": "Hello!"}]


def test_language_and_code_heuristics():
    assert is_english("Write a short poem about the sea and the wind for my daughter, please.")
    assert not is_english("Escribe un poema corto sobre el mar y el viento para mi hija, por favor.")
    assert not is_english("Je veux écrire un poème sur la mer et le vent pour ma fille.")
    assert not is_english("바다에 대한 짧은 시를 써 주세요.")
    assert hangul_ratio("바다에 대한 시를 써 주세요 please") > 0.5
    assert hangul_ratio("ㅋㅋ") == 1.0 and hangul_ratio("how are you?") == 0.0
    assert looks_like_code("Fix this:\n```\nx = 1\n```")
    assert looks_like_code("def add(a, b):\n    return a + b")
    assert looks_like_code("int main() {\n  int x = 1;\n  return x;\n}")
    assert not looks_like_code("Plan a three-day trip to Crete; include food, beaches and history.")


def test_sharegpt_chat_is_english_without_code_and_split_cleanly(home):
    started = time.monotonic()
    train = sharegpt("train", None, 0, home=home)
    first_s = time.monotonic() - started
    started = time.monotonic()
    again = sharegpt("train", None, 0, home=home)
    cached_s = time.monotonic() - started
    held = sharegpt("heldout", None, 0, home=home)
    print(f"\nShareGPT chat: {len(train)} train / {len(held)} heldout; "
          f"first load {first_s:.2f} s, cached {cached_s:.2f} s")
    assert ids(train) == ids(again)
    assert len(train) > 5000 and len(held) > 400
    assert not set(ids(train)) & set(ids(held))
    assert all(split_of(i) == "heldout" for i in ids(held))
    assert (home / "workloads" / "sharegpt-first-turns.jsonl").is_file()
    for p in train + held:
        assert p.workload == "chat" and p.id.startswith("sharegpt/") and p.is_chat
        assert "```" not in text(p) and is_english(text(p)) and 0 < len(text(p)) <= 2000
    assert sum(p.reference is not None for p in train) > 0.95 * len(train)
    assert len({text(p) for p in train}) == len(train)


def test_sharegpt_code_and_korean_kinds(home):
    code_prompts = sharegpt("train", 200, 0, kind="code", home=home)
    assert len(code_prompts) == 200 and all(p.workload == "code" for p in code_prompts)
    assert all(looks_like_code(text(p)) or looks_like_code(p.reference or "") for p in code_prompts)
    korean_prompts = sharegpt("train", None, 0, kind="korean", home=home)
    assert korean_prompts and all(hangul_ratio(text(p)) >= 0.4 for p in korean_prompts)
    with pytest.raises(WorkloadError, match="kind"):
        sharegpt("train", 1, 0, kind="french", home=home)


def test_a_corrupt_cache_is_rebuilt(home):
    expected = ids(sharegpt("heldout", 30, 5, home=home))
    cache = home / "workloads" / "sharegpt-first-turns.jsonl"
    cache.write_text('{"_cache": {"format": -1}}\n{"id": "bogus"}\n')
    assert ids(sharegpt("heldout", 30, 5, home=home)) == expected
    assert json.loads(cache.read_text().splitlines()[0])["_cache"]["format"] >= 1


# --- code and Korean -----------------------------------------------------------------------

def test_code_mixes_humaneval_and_stdlib(home):
    train = code("train", None, 0, home=home)
    held = code("heldout", None, 0, home=home)
    print(f"\ncode: {len(train)} train / {len(held)} heldout")
    assert len(train) > 2000 and len(held) > 100
    assert not set(ids(train)) & set(ids(held))
    assert [p.id.split("/")[0] for p in train[:6]] == ["humaneval", "stdlib"] * 3
    humaneval = [p for p in train + held if p.id.startswith("humaneval/")]
    assert len(humaneval) == 164
    for p in train + held:
        assert p.workload == "code" and "def " in text(p) and p.reference
        assert text(p).startswith("Complete this Python")
        module = p.id.split(":")[0]
        assert ".test." not in module and ".tests." not in module and not module.endswith(".test")
    assert len(set(ids(train))) == len(train)
    assert ids(code("train", 50, 1, home=home)) == ids(code("train", 50, 1, home=home))


def test_stdlib_prompt_is_signature_and_docstring_reference_is_the_body(home):
    p = next(p for p in code("train", None, 0, home=home, sources=("stdlib",)) if p.id.startswith("stdlib/"))
    body = text(p).split("\n\n", 1)[1]
    assert body.lstrip().startswith(("def ", "async def "))
    assert body.rstrip().endswith(('"""', "'''"))
    assert p.reference.strip() and not p.reference.lstrip().startswith("def ")


def test_korean_prompts_are_hangul_and_unique(home):
    train = korean("train", None, 0, home=home)
    held = korean("heldout", None, 0, home=home)
    print(f"\nkorean: {len(train)} train / {len(held)} heldout")
    assert len(train) > 250 and len(held) > 10
    assert not set(ids(train)) & set(ids(held))
    assert all(p.workload == "korean" and hangul_ratio(text(p)) >= 0.4 for p in train + held)
    assert len({text(p) for p in train + held}) == len(train) + len(held)
    assert any(p.id.startswith("sharegpt/") for p in train + held)


# --- operator JSONL files ------------------------------------------------------------------

def test_jsonl_round_trip_and_defaults(tmp_path):
    path = tmp_path / "shift.jsonl"
    path.write_text(
        '{"prompt": "Once upon a time"}\n'
        "\n"
        '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],'
        ' "workload": "support", "id": "t-1", "reference": "Hello"}\n', encoding="utf-8")
    prompts = load_jsonl_workload(path)
    assert [(p.id, p.workload, p.is_chat) for p in prompts] == [("shift/1", "shift", False),
                                                                 ("t-1", "support", True)]
    assert prompts[1].chat_messages()[-1] == {"role": "user", "content": "Hi"}
    copy = write_jsonl_workload(prompts, tmp_path / "copy.jsonl")
    assert load_jsonl_workload(copy) == prompts
    assert load_workload(str(path), n=1) == prompts[:1]


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "x"', "invalid JSON"),
    ('["prompt"]', "expected a JSON object"),
    ('{"promt": "x"}', r"unknown key\(s\) \['promt'\]"),
    ('{"prompt": "x", "messages": [{"role": "user", "content": "x"}]}', "exactly one of"),
    ('{"prompt": "   "}', "'prompt' must be a non-empty string"),
    ('{"messages": []}', "non-empty list"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "role 'robot'"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}',
     "last message must be a non-empty 'user' turn"),
    ('{"prompt": "x", "workload": 3}', "'workload' must be a non-empty string"),
    ('{"prompt": "x", "id": "shift/1"}', "duplicate id"),
])
def test_a_bad_line_is_named_by_its_number(tmp_path, line, message):
    path = tmp_path / "shift.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n", encoding="utf-8")
    with pytest.raises(WorkloadError, match=message) as info:
        load_jsonl_workload(path)
    assert f"{path}:3:" in str(info.value)


def test_empty_or_missing_files_and_unknown_names(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(WorkloadError, match="holds no prompts"):
        load_jsonl_workload(empty)
    with pytest.raises(WorkloadError, match="does not exist"):
        load_workload(str(tmp_path / "missing.jsonl"))
    with pytest.raises(WorkloadError, match="unknown workload"):
        load_workload("math")


def test_load_workload_dispatches_builtin_names(home):
    assert {p.workload for p in load_workload("chat", "heldout", 5, home=home)} == {"chat"}
    assert {p.workload for p in load_workload("sharegpt-code", "heldout", 5, home=home)} == {"code"}
    assert {p.workload for p in load_workload("code", "heldout", 5, home=home)} == {"code"}
    assert {p.workload for p in load_workload("korean", "heldout", 5, home=home)} == {"korean"}


def test_a_workload_is_named_as_people_name_it(tmp_path):
    """A built-in by its name; a file by the one tag its records carry, else its stem (never the path)."""
    assert workload_name("code") == "code" and workload_name("sharegpt-code") == "sharegpt-code"
    tagged = tmp_path / "deep" / "dir" / "prompts.jsonl"
    tagged.parent.mkdir(parents=True)
    tagged.write_text('{"prompt": "a", "workload": "support"}\n{"prompt": "b", "workload": "support"}\n')
    assert workload_name(str(tagged)) == "support"
    untagged = tmp_path / "legal-questions.jsonl"
    untagged.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert workload_name(str(untagged)) == "legal-questions"
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"prompt": "a", "workload": "x"}\n{"prompt": "b", "workload": "y"}\n')
    assert workload_name(str(mixed)) == "mixed"
