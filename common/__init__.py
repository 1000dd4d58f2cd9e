"""What every Glimpse package shares and nothing else: the exception a user can fix, and what a token is."""

from glimpse.common.errors import UserError
from glimpse.common.modality import Modality

__all__ = ["Modality", "UserError"]
