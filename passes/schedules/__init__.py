"""The built-in schedule families; importing this package registers them."""

from passes.schedules import dualpipe, gpipe, interleaved, one_f_one_b  # noqa: F401
