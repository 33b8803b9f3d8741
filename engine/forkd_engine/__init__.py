"""forkd_engine: the sandbox engines and the guest agent. Knows nothing of HTTP or Jupyter."""

from .base import (AgentUnreachable, BranchResult, ChildSpec, Engine, EngineError, EngineUnavailable,
                   InvalidSpec, LimitReached, LossyFork, Session, SnapshotSpec, UnsupportedMode)

__all__ = ["AgentUnreachable", "BranchResult", "ChildSpec", "Engine", "EngineError",
           "EngineUnavailable", "InvalidSpec", "LimitReached", "LossyFork", "Session", "SnapshotSpec", "UnsupportedMode"]
