"""What a prompt token is. ``Prompt.modality`` is a tensor of these values (tensors hold ints, and an
``IntEnum`` compares with them directly: ``prompt.modality != Modality.TEXT`` marks the visual tokens)."""

from enum import IntEnum


class Modality(IntEnum):
    TEXT = 0
    IMAGE = 1
    VIDEO = 2
