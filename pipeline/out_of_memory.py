"""Running out of memory, said as what it is: not a bug in Glimpse, and not a malformed request either.

A 16K-token video on a 24 GB GPU, eight long prompts decoding together, a CPU box without swap: torch raises
``torch.OutOfMemoryError`` (CUDA), or a plain ``RuntimeError`` from its CPU allocator ("can't allocate memory").
Uncaught, the command line called that "a bug in Glimpse", the chat "internal error" and the API a 500 with
torch's allocator statistics. The engine turns it into ``OutOfMemory``, a ``UserError`` whose message says how
large the work was and what makes it smaller, so that the CLI exits 1 with that message, the chat shows it, the
API answers 503 (the same request may fit once other requests end), and the batch captioner splits the batch.

The engine runs that work through ``attempt`` and raises ``OutOfMemory`` once it has returned: raised inside the
``except`` block, the new error would keep torch's error as its context, and that error's traceback keeps every
frame of the failed pass alive, with its hidden states and half-built KV cache, for as long as anyone holds the
error (a server's response, a chat message). Raised after, they are freed before the caller sees the error.
"""

from __future__ import annotations

import re

import torch

from glimpse.common import UserError


class OutOfMemory(UserError):
    """The machine had too little free memory for this work; the message says what would need less."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that failed: CUDA's (and MPS's) ``OutOfMemoryError``, the CPU
    allocator's ``RuntimeError``, or Python's ``MemoryError``."""
    return (isinstance(error, (torch.OutOfMemoryError, MemoryError))
            or (isinstance(error, RuntimeError) and "can't allocate memory" in str(error)))


_TRIED = re.compile(r"[Tt]ried to allocate (\d[\d.]* ?[KMGT]i?B|\d+ bytes)")


def tried_to_allocate(error: BaseException) -> str:
    """", which tried to allocate 2.00 GiB more" from torch's words, or "" where they do not say."""
    found = _TRIED.search(str(error))
    if found is None:
        return ""
    amount = found.group(1)
    if amount.endswith(" bytes"):
        amount = f"{int(amount.split()[0]) / 2**30:,.2f} GiB"
    return f" (it tried to allocate {amount} more)"


def attempt(work):
    """``(work(), None)``, or ``(None, tried_to_allocate(...))`` when it ran out of memory; any other error propagates.
    Once this returns, torch's error is gone, and with its traceback the tensors of the work that failed."""
    try:
        return work(), None
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_memory(error):
            raise
        return None, tried_to_allocate(error)
