"""A drafter service in this process (its loop on a thread) over real ZeroMQ sockets, engines in
remote mode against it, and a two-sample chi-square check (test_lossless.py's)."""
import threading

import torch

TRANSPORTS = ("tcp", "ipc")


class Service:
    """The service's loop on a thread: ``server`` (DraftServer), ``url(kind)``, ``stop()``."""

    def __init__(self, target, drafter, tmp_path, version="v1", max_sessions=16, max_batch_rows=8):
        from tide.drafter.artifact import TargetSpec
        from tide.drafter.vocab import mapping_digest
        from tide.drafting.server import DrafterHost, DraftServer
        from tide.drafting.transport import ServiceSockets
        from tide.drafting.wire import Limits

        spec = TargetSpec(target.shape.hidden_size, target.shape.vocab_size, target.aux_layer_ids, 256)
        self.host = DrafterHost(drafter, version, spec, target.embed_weight, mapping_digest(drafter.d2t))
        self.sockets = ServiceSockets("tcp://127.0.0.1:*", f"ipc://{tmp_path}/drafter.sock", 1 << 26)
        limits = Limits(target.shape.vocab_size, 3 * target.shape.hidden_size, 256, max_rows=max_batch_rows)
        self.server = DraftServer(self.host, self.sockets, limits, max_sessions, 60.0, max_batch_rows)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.server.serve, args=(self._stop,), daemon=True)
        self._thread.start()

    def url(self, kind: str) -> str:
        return self.sockets.endpoints["tcp://" if kind == "tcp" else "ipc://"]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.sockets.close()


def remote_engine(target, url, scheduler="stop_rule", deadline_s=5.0, retry_s=0.05, **kw):
    """A reference engine in remote mode (generous deadline: these tests are about outputs)."""
    from tide.drafting.client import RemoteDrafter
    from tide.engine.reference import ReferenceEngine

    remote = RemoteDrafter(url, target.shape.vocab_size, deadline_s=deadline_s, retry_s=retry_s,
                           connect_timeout_s=30.0)
    return ReferenceEngine(target, None, None, "unused", target_model_id="tiny", draft_len=4, max_batch_size=4,
                           max_seq_len=200, scheduler=scheduler, remote=remote, **kw)


def submit_all(engine, requests, timeout_s=300):
    outs = {}

    def one(req):
        outs[req.request_id] = [t for ev in engine.submit(req) for t in ev.token_ids]
    threads = [threading.Thread(target=one, args=(r,)) for r in requests]
    [t.start() for t in threads]
    [t.join(timeout=timeout_s) for t in threads]
    return [outs[r.request_id] for r in requests]


def prompts(vocab: int, n: int, seed: int = 0, length: int = 12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def assert_same_distribution(spec: dict, plain: dict, n: int) -> None:
    """Chi-square over the tokens both samplers drew often enough: one distribution, not two."""
    from scipy.stats import chi2_contingency

    common = [k for k in set(spec) | set(plain) if spec.get(k, 0) + plain.get(k, 0) >= 20]
    table = [[spec.get(k, 0) for k in common] + [n - sum(spec.get(k, 0) for k in common)],
             [plain.get(k, 0) for k in common] + [n - sum(plain.get(k, 0) for k in common)]]
    assert len(common) >= 2, (spec, plain)
    assert chi2_contingency(table).pvalue > 1e-3, table
