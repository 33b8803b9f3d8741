"""The process engine: Linux namespaces, seccomp and cgroups around fork()ed interpreters."""

from .engine import ProcessEngine

__all__ = ["ProcessEngine"]
