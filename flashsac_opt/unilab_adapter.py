"""Former home of the UniLab adapter, kept so an outdated UniLab patch fails with a clear message.

Patch 0001 up to v3 makes UniLab's runner import ``flashsac_opt.unilab_adapter``; the adapter
now lives in ``flashsac_opt.unilab.adapter``. A UniLab tree still carrying such a patch reaches
this module at train time and gets an error that says how to upgrade it, not a bare
``ModuleNotFoundError``.
"""

from __future__ import annotations

from typing import Any

_MESSAGE = (
    "this UniLab tree carries an earlier flashsac_opt patch (0001 before v4), which imports "
    "flashsac_opt.unilab_adapter; the adapter is now flashsac_opt.unilab.adapter. "
    "Run `flashsac-opt unilab apply` (with --root PATH for a checkout) to upgrade the patch."
)


class OutdatedUniLabPatchError(RuntimeError):
    """UniLab was patched by an earlier flashsac_opt; `flashsac-opt unilab apply` upgrades it."""


def build_unilab_learner(*_args: Any, **_kwargs: Any) -> Any:
    raise OutdatedUniLabPatchError(_MESSAGE)


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise OutdatedUniLabPatchError(_MESSAGE)
