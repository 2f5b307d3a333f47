"""Fixtures for fast unit tests: tiny random models built in code, one torch thread."""
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    from tide.models.llama import LlamaTarget
    from tide.models.tiny import tiny_llama_checkpoint

    folder = tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny") / "target")
    return LlamaTarget.from_folder(folder, aux_layer_ids=(1, 2, 3), max_seq_len=256)


@pytest.fixture(scope="session")
def tiny_drafter(tiny_target):
    from tide.train.offline import new_drafter

    counts = torch.arange(tiny_target.shape.vocab_size).flip(0)
    drafter = new_drafter(tiny_target, tiny_target.shape.vocab_size // 2, counts, seed=1)
    return drafter.eval()


@pytest.fixture(scope="session")
def agreeing_drafter(tiny_target):
    """(drafter, prompts): a tiny drafter trained on the tiny target's own greedy answers to
    ``prompts`` until its drafts are accepted often there (several tokens per target forward), for
    tests where a step must commit more than one token; ~2 s."""
    from tide.train.offline import generate_samples, new_drafter
    from tide.train.trainer import train

    vocab = tiny_target.shape.vocab_size
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, vocab, (12,), generator=g).tolist() for _ in range(4)]
    drafter = new_drafter(tiny_target, vocab // 2, torch.arange(vocab).flip(0), seed=1)
    samples = generate_samples(tiny_target, prompts, 64, (), progress=False)
    train(drafter, tiny_target.embed_weight, tiny_target.lm_head_weight, samples, epochs=120, lr=3e-3,
          batch_tokens=512, max_len=128, ttt_length=4, step_weight=0.8, progress=False)
    return drafter.eval(), prompts


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """(root, tracking URI): a real MLflow SQLite store, one per test module."""
    root = tmp_path_factory.mktemp("mlflow")
    return root, f"sqlite:///{root / 'mlflow.db'}"


@pytest.fixture
def registry(store, tmp_path):
    """A Registry on ``store`` with a model name of its own: tests never see each other's versions."""
    import uuid

    from tide.config import RegistryConfig
    from tide.registry import Registry

    root, uri = store
    cfg = RegistryConfig(tracking_uri=uri, registered_model_name=f"drafter-{uuid.uuid4().hex[:8]}",
                         artifact_location=(root / "artifacts").as_uri(), cache_dir=str(tmp_path / "cache"))
    return Registry(cfg, tmp_path / "home")
