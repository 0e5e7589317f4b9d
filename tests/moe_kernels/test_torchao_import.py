"""torchao is imported without the deprecation notices torch prints about torchao's enums."""

from __future__ import annotations

import enum
import io
import logging

import torch.utils._pytree as pytree

from moe_kernels import quiet_torchao_import


def _logged_while_registering(make_enum, quiet: bool) -> str:
    """What torch logs while registering a fresh enum as a pytree constant, as torchao's
    import does for KernelPreference."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("torch.utils._pytree")
    logger.addHandler(handler)
    try:
        if quiet:
            with quiet_torchao_import():
                pytree.register_constant(make_enum())
        else:
            pytree.register_constant(make_enum())
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def _fresh_enum() -> type[enum.Enum]:
    return enum.Enum("Preference", {"AUTO": "auto"}, type=str)


def test_the_enum_registration_notice_is_dropped_inside_the_block_only():
    loud = _logged_while_registering(_fresh_enum, quiet=False)
    if "is an Enum subclass" not in loud:  # torch before enums were opaque: no notice at all
        return
    assert _logged_while_registering(_fresh_enum, quiet=True) == ""
    assert not logging.getLogger("torch.utils._pytree").filters  # removed after the block
