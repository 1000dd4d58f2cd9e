"""What every Glimpse package shares and nothing else: the exception a user can fix, and what a token is."""

from common.errors import UserError
from common.modality import Modality

__all__ = ["Modality", "UserError"]
