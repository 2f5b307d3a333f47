"""The engine's drafter control API: check, list, promote, roll back, operation history.

Mounted by ``tide.engine.server.build_app`` under ``/control`` (``control_plane``) when the engine
runs a DrafterFollower; every route sits behind the server's bearer-token dependency (401 without the
configured ``server.control_token``). Routes are sync functions: FastAPI runs them in its thread
pool, so registry calls and smoke decodes never block the event loop that streams tokens.

The actor recorded with an operation is ``api`` (the token holder), or ``api:<actor>`` when the
body names one. Errors: 400 bad body, 404 unknown version, 409 refused version or nothing to roll
back to, 503 registry unreachable (the engine keeps serving what it has).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from tide import metrics
from tide.engine.server import ControlPlane
from tide.ops.follower import DrafterFollower
from tide.ops.operations import OpsError


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    actor: str | None = Field(default=None, min_length=1, max_length=100, pattern=r"^[\w.@:-]+$")
    reason: str = Field(default="", max_length=1000)


class PromoteBody(_Body):
    version: int = Field(ge=1, le=2**31 - 1)  # MLflow versions are small; 2**70 is a 400, not a 503


class RollbackBody(_Body):
    pass


def _actor(body: _Body | None) -> str:
    return f"api:{body.actor}" if body is not None and body.actor else "api"


def control_plane(ops: DrafterFollower) -> ControlPlane:
    """What the engine service hands ``build_app``: these routes and the follower's health view."""
    return ControlPlane(control_router(ops), ops.health)


def control_router(ops: DrafterFollower) -> APIRouter:
    """Routes over ``ops``; the caller adds the auth dependency when including the router."""
    router = APIRouter(prefix="/control")

    def run(op: str, fn, *args) -> Any:
        try:
            result = fn(*args)
        except OpsError as exc:
            metrics.OPS_OPERATIONS.labels(op, str(exc.status)).inc()
            raise HTTPException(exc.status, str(exc)) from exc
        metrics.OPS_OPERATIONS.labels(op, "ok").inc()
        return result

    @router.post("/check")
    def check() -> dict:
        return dataclasses.asdict(ops.check_now())

    @router.get("/drafters")
    def drafters() -> dict:
        return run("list", ops.drafters)

    @router.post("/promote")
    def promote(body: PromoteBody) -> dict:
        return run("promote", ops.promote, body.version, _actor(body), body.reason)

    @router.post("/rollback")
    def rollback(body: RollbackBody | None = None) -> dict:
        return run("rollback", ops.rollback, _actor(body), body.reason if body else "")

    @router.get("/operations")
    def operations() -> dict:
        return {"operations": run("operations", ops.operations)}

    return router
