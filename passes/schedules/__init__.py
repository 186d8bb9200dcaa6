"""The built-in schedule families; importing this package registers them."""

from passes.schedules import gpipe, interleaved, one_f_one_b, zb_auto, zero_bubble  # noqa: F401
