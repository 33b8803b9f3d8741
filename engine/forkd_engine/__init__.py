"""forkd_engine: the sandbox engines and the guest agent. Knows nothing of HTTP or Jupyter."""

from .base import (AgentUnreachable, BranchResult, Cancelled, ChildSpec, Engine, EngineError, EngineUnavailable,
                   ExitStatus, InvalidSpec, LimitHit, LimitReached, LossyFork, Session, SnapshotSpec, UnsupportedMode)

__all__ = ["AgentUnreachable", "BranchResult", "Cancelled", "ChildSpec", "Engine", "EngineError",
           "EngineUnavailable", "ExitStatus", "InvalidSpec", "LimitHit", "LimitReached", "LossyFork", "Session", "SnapshotSpec", "UnsupportedMode"]
