"""Independent measurements: what a step costs and what it holds, read from torch itself (live storages, the
dispatched aten ops), never from a feature's own counters."""

from megalm.measure.storage import LiveStorages, is_higher_order, storage_bytes, storage_identity

__all__ = ["LiveStorages", "is_higher_order", "storage_bytes", "storage_identity"]
