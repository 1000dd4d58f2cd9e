"""Files that ship inside the Glimpse package (``glimpse.assets``): the embedded model's trained weights
(projector, adapters, colour input), its calibrated speed/quality frontier, the label-free calibration set
and the README's sample image and video.

They are package data, found through ``importlib.resources``: in a wheel install they sit beside this file in
site-packages, in an editable install this is the repository's ``assets/`` folder.
"""

from importlib.resources import files
from pathlib import Path

# Wheels are unpacked on disk (never imported from a zip), so the package's data is a real directory.
ASSETS = Path(str(files(__name__)))
