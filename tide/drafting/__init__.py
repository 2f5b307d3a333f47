"""The drafter as its own service: one drafter process drafts for several target engines.

``wire.py`` what an engine and the service exchange; ``transport.py`` how (shared memory on one
host, ZeroMQ across hosts); ``sessions.py`` the service's per-request drafter state; ``server.py``
the service's work-conserving drafting loop; ``client.py`` the engine's side (deadline, fallback
to target-only steps, the verify of the service's drafts).
"""
