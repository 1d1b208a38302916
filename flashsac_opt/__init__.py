"""flashsac_opt: a compile-first FlashSAC learner for UniLab."""

from flashsac_opt.config import FlashSACConfig
from flashsac_opt.learner import FlashSACLearner

__version__ = "0.1.0"
__all__ = ["FlashSACConfig", "FlashSACLearner", "__version__"]
