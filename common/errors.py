"""The one exception type for mistakes the user can fix.

An unknown policy or parameter, a speed outside [0, 1], an unreadable or unsupported file, a prompt
over the context length, a checkpoint that is not there: each raises ``UserError`` (or a subclass:
``vision.MediaError``, ``pipeline.PromptError``, ``pipeline.ModelLoadError``), and the CLI, the API and
the chat report its message as the user's to fix (CLI exit 1, HTTP 400, a chat message). Anything else
that escapes — a ``ValueError`` from deep in torch included — is Glimpse's bug and is reported as one
(CLI exit 2 with "internal error", HTTP 500), never blamed on the user. It subclasses ``ValueError`` so
that code written against the older ``ValueError`` contract keeps working.

This package imports nothing, so every other one (vision, pruning, pipeline, app) can use it.
"""


class UserError(ValueError):
    """A request the user can fix; the message says how."""
