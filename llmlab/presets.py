"""Named presets of a configuration dataclass: `GPTConfig.preset("tiny", dropout=0.1)`, `TrainConfig.preset(...)`."""

from __future__ import annotations

from dataclasses import fields, replace

__all__ = ["from_preset"]


def from_preset(cls, presets: dict, name: str, **overrides):
    """`presets[name]` (an instance of the dataclass `cls`) with `overrides` replaced; a ValueError names an
    unknown preset or a field `cls` does not have."""
    if name not in presets:
        raise ValueError(f"name={name!r} is not a preset; choose from {list(presets)}")
    unknown = set(overrides) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"overrides {sorted(unknown)} are not {cls.__name__} fields")
    return replace(presets[name], **overrides)
