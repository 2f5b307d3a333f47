"""``SGLangEngine``: the engine contract (tide/engine/base.py) over a running SGLang server's HTTP API.

Runs in TIDE's process beside the server (server_args.py), so the drafter follower, the collapse
guard, the control API and the OpenAI front end work unchanged. Capture does not pass through
here: the plugin inside SGLang's scheduler produces it (plugin.py). Members:
- ``submit``: ``POST /generate`` with the prompt's token ids, streamed; ``custom_params`` carry the
  workload tag and the capture opt-out to the plugin (capture.py). SGLang's prefix cache serves a
  cached prompt start without computing its hidden states, so such requests are never captured;
  ``full_capture_fraction`` of the requests the capture samples (``capture_policy``) get a
  ``cache_salt`` of their own (SGLang's per-request cache namespace): no prefix matches, the whole
  prompt is computed and captured, at the cost of recomputing it (docs/design/sglang.md);
- ``validate_drafter``: off the serving path, the same checks SGLang's TIDE loader repeats
  (weights.prepare: artifact, sha256, shape = the serving draft model's, vocab mapping = the
  serving one). No smoke decode: SGLang verifies every drafted token with the target, so a
  drafter cannot change output, only acceptance (the collapse guard watches that);
- ``swap_drafter``: ``/pause_generation`` in place (running requests stay resident; without it the
  update would wait for every in-flight request to end), then SGLang's weight-update session for
  the draft only: ``/begin_weight_update`` -> ``/update_weights_from_tensor`` ->
  ``/end_weight_update``, each with ``selector: "draft"`` (the default "all" also loads the
  target); the tensor is a manifest, loaded by TIDE's loader (``load_format``), ``flush_cache``
  off; then ``/continue_generation``. Applied when the loader's ``tide_engine_drafter_info`` names
  the version, else ``DrafterError`` and the old drafter keeps serving. SGLang refuses tensor
  updates with data-parallel replicas (dp_size > 1);
- ``stats``: the plugin's ``tide_engine_*`` counters read back from SGLang's ``/metrics``.
"""
from __future__ import annotations

import base64
import json
import logging
import pickle
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from tide.capture.sampling import SamplingPolicy, unit_hash
from tide.drafter.artifact import DrafterError, read_metadata
from tide.engine.base import CaptureSink, Engine, EngineStats, GenerationRequest, TokenEvent, VersionAcceptance
from tide.engine.sglang import weights
from tide.engine.sglang.capture import CAPTURE_PARAM, WORKLOAD_PARAM
from tide.engine.sglang.server_args import LOADER
from tide.metrics_text import Families, by_label, parse

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SGLangDrafter:
    """A validated drafter folder: the handle ``swap_drafter`` takes and a rollback re-serves."""

    folder: Path
    sha256: str


def serialize_named_tensors(named: list, tp_size: int) -> list[str]:
    """``serialized_named_tensors`` of /update_weights_from_tensor: one entry per TP rank. Plain
    pickle keeps CPU tensors inline (SGLang's SafeUnpickler accepts them); ForkingPickler would
    send file descriptors that only live while this process does."""
    payload = base64.b64encode(pickle.dumps(named)).decode()
    return [payload] * tp_size


class SGLangEngine(Engine):
    def __init__(self, base_url: str, serving_folder: Path, version: str, *, target_model_id: str,
                 max_seq_len: int, tokenizer: Any = None, tp_size: int = 1, timeout_s: float = 600.0,
                 api_key: str | None = None, capture_policy: SamplingPolicy | None = None,
                 full_capture_fraction: float = 0.0) -> None:
        if not 0.0 <= full_capture_fraction <= 1.0:
            raise ValueError(f"full_capture_fraction must be in [0, 1], got {full_capture_fraction}")
        self.base_url = base_url.rstrip("/")
        self.capture_policy, self.full_capture_fraction = capture_policy, full_capture_fraction
        self.tokenizer = tokenizer
        self.target_model_id = target_model_id
        self.max_seq_len = max_seq_len
        self.tp_size = tp_size
        self.timeout_s = timeout_s
        self._api_key = api_key
        folder = Path(serving_folder)
        self._serving_shape = weights.shape_of_config(json.loads((folder / "config.json").read_text()))
        meta = read_metadata(folder)
        if "vocab_mapping" not in meta:
            raise DrafterError(f"{folder}: tide.json has no vocab_mapping")
        self._serving_mapping = meta["vocab_mapping"]
        self._drafter = SGLangDrafter(folder, meta.get("sha256", ""))
        self._version = version
        self._last_swap_pause_s = 0.0
        self._lock = threading.Lock()
        self._stats = EngineStats()

    # --- identity -----------------------------------------------------------------------------
    @property
    def drafter_version(self) -> str:
        return self._version

    @property
    def drafter(self) -> SGLangDrafter:
        return self._drafter

    @property
    def last_swap_pause_s(self) -> float:
        return self._last_swap_pause_s

    # --- drafters -----------------------------------------------------------------------------
    def validate_drafter(self, folder: Path, smoke_prompt_ids: list[int]) -> SGLangDrafter:
        folder = Path(folder)
        if not folder.is_dir():
            raise DrafterError(f"{folder}: not a drafter folder")
        weights.prepare(folder, self._serving_shape, self._serving_mapping)
        return SGLangDrafter(folder, read_metadata(folder)["sha256"])

    def swap_bodies(self, drafter: SGLangDrafter, version: str) -> dict[str, dict]:
        """The JSON bodies of one swap, by SGLang route, in the order they are sent."""
        named = weights.manifest(drafter.folder, version)
        return {"/pause_generation": {"mode": "in_place"},
                "/begin_weight_update": {"selector": "draft"},
                "/update_weights_from_tensor": {
                    "serialized_named_tensors": serialize_named_tensors(named, self.tp_size),
                    "load_format": LOADER, "selector": "draft", "flush_cache": False,
                    "abort_all_requests": False, "weight_version": str(version)},
                "/end_weight_update": {}, "/continue_generation": {}}

    def swap_drafter(self, drafter: SGLangDrafter, version: str) -> None:
        t0 = time.perf_counter()
        body = self.swap_bodies(drafter, version)
        self._post("/pause_generation", body["/pause_generation"])
        try:
            self._post("/begin_weight_update", body["/begin_weight_update"])
            try:
                self._post("/update_weights_from_tensor", body["/update_weights_from_tensor"])
            finally:
                self._post("/end_weight_update", body["/end_weight_update"])
        finally:
            self._post("/continue_generation", body["/continue_generation"])
        if self.served_versions() != {str(version)}:
            raise DrafterError(f"SGLang's TIDE loader did not apply {version} (serving "
                               f"{sorted(self.served_versions())}); see the server log")
        self._last_swap_pause_s = time.perf_counter() - t0
        self._drafter, self._version = drafter, str(version)

    def served_versions(self) -> set[str]:
        """Versions the plugin's loaders report serving (one per scheduler process)."""
        return {s.labels["drafter_version"] for s in self._metrics().get("tide_engine_drafter_info", [])
                if s.value == 1.0 and "drafter_version" in s.labels}

    # --- generation ---------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> Iterator[TokenEvent]:
        total = len(request.prompt_ids) + request.sampling.max_new_tokens
        if not request.prompt_ids or total > self.max_seq_len:
            raise ValueError(f"prompt ({len(request.prompt_ids)}) + max_new_tokens "
                             f"({request.sampling.max_new_tokens}) must be in 1..{self.max_seq_len}")
        return self._stream(request)

    def _sampling(self, request: GenerationRequest) -> dict:
        sp = request.sampling
        out = {"max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
               "ignore_eos": sp.ignore_eos, "stop_token_ids": list(sp.stop_token_ids),
               "custom_params": {WORKLOAD_PARAM: request.workload, CAPTURE_PARAM: request.capture}}
        if sp.top_k > 0:  # SGLang's default is "all"
            out["top_k"] = sp.top_k
        if sp.seed is not None:
            out["sampling_seed"] = sp.seed
        return out

    def generate_body(self, request: GenerationRequest) -> dict:
        """The ``/generate`` JSON body of ``request`` (streamed, token ids in and out)."""
        body = {"input_ids": list(request.prompt_ids), "sampling_params": self._sampling(request),
                "stream": True, "rid": request.request_id}
        if self.captured_in_full(request):
            body["cache_salt"] = f"tide-full-capture:{request.request_id}"  # a namespace no other request has
        return body

    def captured_in_full(self, request: GenerationRequest) -> bool:
        """Whether ``request`` is in the sampled share that bypasses SGLang's prefix cache: captured
        (the plugin's policy decides the same from the same id) and drawn by a second hash of its id."""
        policy = self.capture_policy
        if policy is None or not request.capture or self.full_capture_fraction <= 0.0:
            return False
        if not policy.admits(request.request_id, request.workload):
            return False
        return unit_hash(request.request_id + "#full") < self.full_capture_fraction

    def _stream(self, request: GenerationRequest) -> Iterator[TokenEvent]:
        body = self.generate_body(request)
        sent, outcome = 0, "error"
        try:
            with self._open("/generate", body) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    ids = chunk.get("output_ids") or []  # cumulative (SGLang's default streaming)
                    reason = (chunk.get("meta_info", {}).get("finish_reason") or {}).get("type")
                    new, sent = tuple(ids[sent:]), max(sent, len(ids))
                    if reason is not None:
                        outcome = "ok" if reason in ("stop", "length") else "error"
                        yield TokenEvent(new, True, reason if outcome == "ok" else "error",
                                         None if outcome == "ok" else f"SGLang finished with {reason}")
                        return
                    if new:
                        yield TokenEvent(new)
            yield TokenEvent((), True, "error", "SGLang closed the stream without a finish reason")
        except (OSError, ValueError) as exc:
            yield TokenEvent((), True, "error", f"SGLang request failed: {exc}")
        finally:
            with self._lock:
                self._stats.tokens_generated += sent
                self._stats.requests_finished += int(outcome == "ok")
                self._stats.requests_failed += int(outcome != "ok")

    # --- reading --------------------------------------------------------------------------------
    def set_capture_sink(self, sink: CaptureSink | None) -> None:
        """Capture runs inside SGLang (the plugin's tap); a sink here would never be offered a step."""
        if sink is not None:
            raise ValueError("SGLang captures inside its scheduler; configure capture.* for the plugin")

    def stats(self) -> EngineStats:
        with self._lock:
            st = self._stats.copy()
        st.acceptance = self.acceptance_of(self._metrics())
        st.target_forwards = sum(v.forwards for v in st.acceptance.values())
        return st

    @staticmethod
    def acceptance_of(families: Families) -> dict[str, VersionAcceptance]:
        """EngineStats.acceptance from the plugin's series (summed over SGLang's processes): target
        forwards (request rows), accepted draft tokens, committed tokens (the accept-length sum)."""
        fields = {"forwards": "tide_engine_target_forwards_total",
                  "accepted": "tide_engine_accepted_draft_tokens_total",
                  "committed": "tide_engine_accept_length_tokens_sum"}
        counts = {f: by_label(families, name, "drafter_version") for f, name in fields.items()}
        versions = set().union(*counts.values())
        return {v: VersionAcceptance(**{f: int(c.get(v, 0)) for f, c in counts.items()}) for v in versions}

    def health(self) -> dict[str, Any]:
        try:
            with self._open("/health", None, timeout_s=5.0):
                reachable = True
        except OSError:
            reachable = False
        return {"drafter_version": self._version, "target_model_id": self.target_model_id,
                "server_reachable": reachable, "last_swap_pause_s": self._last_swap_pause_s}

    def close(self) -> None:
        """The server belongs to the launcher, which stops it."""

    # --- HTTP -----------------------------------------------------------------------------------
    def _open(self, path: str, body: dict | None, timeout_s: float | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method="POST" if data else "GET")
        req.add_header("Content-Type", "application/json")
        if self._api_key:
            req.add_header("Authorization", f"Bearer {self._api_key}")
        return urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s)

    def _post(self, path: str, body: dict) -> dict:
        try:
            with self._open(path, body) as resp:
                answer = json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise DrafterError(f"SGLang {path}: HTTP {exc.code}: {exc.read()[:300]!r}") from exc
        except OSError as exc:
            raise DrafterError(f"SGLang {path}: {exc}") from exc
        if isinstance(answer, dict) and answer.get("success") is False:
            raise DrafterError(f"SGLang {path}: {answer.get('message')}")
        return answer

    def _metrics(self) -> Families:
        """The tide_engine_* families of SGLang's /metrics ({} while it cannot be reached)."""
        try:
            with self._open("/metrics", None, timeout_s=10.0) as resp:
                return parse(resp.read().decode(), prefix="tide_engine_")
        except OSError as exc:
            log.warning("SGLang /metrics unreachable: %s", exc)
            return {}
