"""Benchmarks as their owners publish them: one adapter per family reads a row of the hub's schema into
the kit's Item (question, lettered options, gold, how it is scored); every row asked for is either an
item or an excluded row with its reason."""

from .adapter import Adapter
from .item import (
    CHOICE,
    EXACT,
    JUDGED,
    MATH,
    NEEDS_IMAGE,
    NO_GOLD,
    OVER_CONTEXT,
    REASONS,
    UNREADABLE,
    Adapted,
    Exclude,
    ExcludedRow,
    Item,
)
from .registry import UnknownSchema, adapt, adapter_for, adapters

__all__ = [
    "CHOICE",
    "EXACT",
    "JUDGED",
    "MATH",
    "NEEDS_IMAGE",
    "NO_GOLD",
    "OVER_CONTEXT",
    "REASONS",
    "UNREADABLE",
    "Adapted",
    "Adapter",
    "Exclude",
    "ExcludedRow",
    "Item",
    "UnknownSchema",
    "adapt",
    "adapter_for",
    "adapters",
]
