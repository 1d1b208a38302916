"""flashsac_opt: a compile-first FlashSAC learner for UniLab."""

__version__ = "0.1.0"
__all__ = ["FlashSACConfig", "FlashSACLearner", "__version__"]


def __getattr__(name: str):
    # Lazy: `flashsac_opt.unilab.collector_start` runs at the top of UniLab's train script, before
    # torch is imported; importing the learner here would put torch's import in front of it.
    if name == "FlashSACConfig":
        from flashsac_opt.config import FlashSACConfig
        return FlashSACConfig
    if name == "FlashSACLearner":
        from flashsac_opt.learner import FlashSACLearner
        return FlashSACLearner
    raise AttributeError(f"module 'flashsac_opt' has no attribute {name!r}")
