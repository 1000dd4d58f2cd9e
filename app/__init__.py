"""Glimpse: chat with vision-language models about images and videos, faster.

Installed, everything lives under this one import name (see pyproject.toml): ``glimpse.pipeline`` (load_engine,
the engine), ``glimpse.pruning`` (the policies and the slider), ``glimpse.vision`` (media and the vision
encoder), ``glimpse.assets`` (shipped weights) and, here, the application: the ``glimpse`` CLI, the web chat,
the HTTP API and batch captioning.

    from glimpse.pipeline import load_engine
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("glimpse-vl")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"
