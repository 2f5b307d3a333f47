"""TIDE's SGLang engine: a plugin SGLang loads next to itself (no fork, no core patch).

- plugin.py: the ``sglang.srt.plugins`` entry point; hooks registered with SGLang's HookRegistry
  (start-up checks, the final-hidden-state output, capture after each prefill and verify) and the
  draft-only weight loader; runs inside SGLang's scheduler processes.
- capture.py: SGLang's batch/result objects -> TIDE StepCaptures (committed positions only).
- weights.py: a TIDE drafter folder checked against and loaded into SGLang's EAGLE3 draft model.
- server_args.py: the supported SGLang releases, the start-up checks, and the server command and
  environment ``tide serve --engine sglang`` (tide/services/sglang_engine.py) starts SGLang with.
- engine.py: ``SGLangEngine``, the engine contract (tide/engine/base.py) over SGLang's HTTP API,
  for the drafter follower, the control API and the demo; draft-only swaps.
Nothing here imports sglang at module level; plugin.py only inside the hooks SGLang calls.
"""
