"""The official ``openai`` Python client against the engine's HTTP server on loopback.

Behind the server runs the real reference engine (batched EAGLE3 speculative decoding) on the tiny
target of tide/models/tiny.py with its own tokenizer and an untrained drafter (so most drafts are
rejected and the correction path runs). Greedy output must be token-for-token the target's own
greedy output, whatever fields the client sends.
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from tide.config import EngineConfig, ServerConfig, default_home
from tide.engine.reference import ReferenceEngine, eos_ids_of
from tide.engine.server import HttpServer, build_app
from tide.models.llama import LlamaTarget
from tide.models.tiny import tiny_llama_checkpoint
from tide.spec.generate import generate
from tide.train.offline import new_drafter

PROMPTS = ["The quick brown fox", "def fibonacci(n: int)", "How do I make a cup of tea?", "class Stack:"]
ENGINE_CFG = EngineConfig(max_batch_size=4, max_prompt_tokens=128, max_new_tokens_limit=64,
                          default_max_new_tokens=16)


class GateSink:
    """A capture sink that records prompt captures and, while ``gate`` is clear, holds the decode
    loop inside its first offer (so requests submitted meanwhile stay queued)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.prefilled: list[str] = []

    def offer(self, captures) -> None:
        for c in captures:
            if c.is_prompt:
                self.prefilled.append(c.meta.request_id)
        self.entered.set()
        self.gate.wait(30)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    folder = tiny_llama_checkpoint(tmp_path_factory.mktemp("openai-tiny") / "target")
    target = LlamaTarget.from_folder(folder, aux_layer_ids=(1, 2, 3), max_seq_len=256)
    tok = AutoTokenizer.from_pretrained(folder)
    drafter = new_drafter(target, 256, torch.arange(512).flip(0), seed=1).eval()
    engine = ReferenceEngine(target, tok, drafter, "random", target_model_id="tiny", draft_len=3,
                             max_batch_size=4, max_seq_len=256, eos_ids=eos_ids_of(tok, folder))
    server = HttpServer(build_app(engine, ServerConfig(max_body_bytes=65_536), ENGINE_CFG), "127.0.0.1", 0,
                        grace_s=1, log_level="warning")
    url = f"http://127.0.0.1:{server.start()}"
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield SimpleNamespace(target=target, tok=tok, engine=engine, url=url, client=client,
                          eos=eos_ids_of(tok, folder), folder=folder)
    server.stop()
    engine.close()


def target_alone(tiny, ids: list[int], max_tokens: int, stop: tuple[int, ...] | None = None) -> str:
    out, _ = generate(tiny.target, None, ids, max_tokens, stop_ids=tiny.eos if stop is None else stop)
    return tiny.tok.decode(out, skip_special_tokens=True)


def chat_ids(tiny, content: str) -> list[int]:
    text = tiny.tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=False)
    return tiny.tok.encode(text, add_special_tokens=False)


def test_completions_greedy_equals_the_target_alone_under_batching(tiny) -> None:
    def one(prompt: str):
        return tiny.client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0, seed=5, user="u1",
            frequency_penalty=0, presence_penalty=0, extra_body={"top_k": 0})

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, PROMPTS))
    for prompt, res in zip(PROMPTS, results):
        assert res.choices[0].text == target_alone(tiny, tiny.tok.encode(prompt), 24)
        assert res.usage.prompt_tokens == len(tiny.tok.encode(prompt))


def test_chat_with_max_completion_tokens_and_fields_that_do_not_change_generation(tiny) -> None:
    res = tiny.client.chat.completions.create(
        model="tiny", messages=[{"role": "developer", "content": "x"}, {"role": "user", "content": PROMPTS[1]}],
        max_completion_tokens=20, temperature=1e-40, metadata={"k": "v"}, store=False,
        service_tier="auto", seed=1, logprobs=False, n=1)
    ids = tiny.tok.encode(tiny.tok.apply_chat_template(
        [{"role": "system", "content": "x"}, {"role": "user", "content": PROMPTS[1]}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    assert res.choices[0].message.content == target_alone(tiny, ids, 20)
    assert res.usage.completion_tokens <= 20


def test_stream_with_usage_ignore_eos_and_token_id_prompt(tiny) -> None:
    ids = tiny.tok.encode(PROMPTS[2])
    chunks = list(tiny.client.completions.create(
        model="tiny", prompt=ids, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "min_tokens": 30}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == target_alone(tiny, ids, 30, stop=())
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30  # eos did not stop it
    assert chunks[-2].choices[0].finish_reason == "length"


def test_stop_token_ids_end_the_request_at_that_token(tiny) -> None:
    ids = tiny.tok.encode(PROMPTS[0])
    out, _ = generate(tiny.target, None, ids, 24)
    stop_at = out[5]
    res = tiny.client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0,
                                         stop=None, extra_body={"stop_token_ids": [stop_at]})
    first = out.index(stop_at)
    assert res.choices[0].finish_reason == "stop" and res.usage.completion_tokens == first + 1


@pytest.mark.parametrize("kwargs,param", [
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"frequency_penalty": 0.3}, "frequency_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format")])
def test_what_tide_cannot_honour_is_a_400_naming_it(tiny, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        tiny.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, **kwargs)
    assert err.value.status_code == 400 and param in err.value.message


def test_a_tiny_temperature_in_the_batch_fails_nobody(tiny) -> None:
    """Was a 500 for the whole batch: logits / 1e-40 overflowed inside the decode step."""
    def one(i: int):
        return tiny.client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=16,
                                              temperature=1e-40 if i == 0 else 0)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    for prompt, res in zip(PROMPTS, results):
        assert res.choices[0].text == target_alone(tiny, tiny.tok.encode(prompt), 16)


def test_a_queued_request_whose_client_left_is_never_prefilled(tiny) -> None:
    sink = GateSink()
    tiny.engine.set_capture_sink(sink)
    try:
        holder = threading.Thread(target=lambda: httpx.post(tiny.url + "/v1/completions", timeout=60,
                                                            json={"prompt": "hold", "max_tokens": 4}))
        holder.start()
        assert sink.entered.wait(10)  # the decode loop now sits in the sink: the next request queues
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(tiny.url + "/v1/completions", json={"prompt": "leaving", "max_tokens": 4}, timeout=0.5)
        deadline = threading.Event()
        for _ in range(100):  # the server notices the disconnect and cancels the queued request
            if httpx.get(tiny.url + "/health").json()["inflight_requests"] <= 1:
                break
            deadline.wait(0.05)
        sink.gate.set()
        holder.join(30)
        assert len(sink.prefilled) == 1, sink.prefilled  # only the holder's prompt was ever prefilled
    finally:
        tiny.engine.set_capture_sink(None)
        sink.gate.set()


def guidellm() -> str:
    """The guidellm command: scripts/install.sh puts it in a virtual environment of its own."""
    venv = Path(os.environ.get("TIDE_GUIDELLM_VENV") or default_home() / "venvs" / "guidellm")
    if not (venv / "bin" / "guidellm").exists():
        pytest.skip(f"guidellm is not installed in {venv}: run scripts/install.sh")
    return str(venv / "bin" / "guidellm")


def test_guidellm_load_generator_gets_no_failed_request(tiny, tmp_path) -> None:
    """guidellm (vLLM's load generator) as its users run it: 4 concurrent streams, synthetic
    prompts of a fixed token count, fixed output length (it sends ignore_eos, max_completion_tokens
    and stream_options.continuous_usage_stats, each once answered with a 400)."""
    requests, out_tokens, report = 12, 8, tmp_path / "guidellm.json"
    argv = [guidellm(), "run", "--backend", f"kind=openai_http,target={tiny.url},request_format=/v1/chat/completions",
            "--profile", "kind=concurrent,streams=4", "--constraint", f"kind=max_requests,count={requests}",
            "--data", f"kind=synthetic_text,prompt_tokens=24,output_tokens={out_tokens}",
            "--tokenizer", f"kind=hf_auto,model={tiny.folder}", "--output", f"kind=json,path={report}",
            "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    done = json.loads(report.read_text())["benchmarks"][0]["requests"]
    failed = done["errored"] + done["incomplete"]
    assert not failed, failed[0]["info"].get("error")
    assert len(done["successful"]) == requests
