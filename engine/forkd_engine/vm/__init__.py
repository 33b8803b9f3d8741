"""The VM engine: QEMU microVMs (KVM where usable, TCG otherwise) with file snapshots."""

from .engine import VMEngine
from .host import kvm_status, qemu_binary

__all__ = ["VMEngine", "kvm_status", "qemu_binary"]
