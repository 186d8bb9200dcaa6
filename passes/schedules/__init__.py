"""The built-in schedule families; importing this package registers them."""

from pipec.passes.schedules import (  # noqa: F401
    bitpipe,
    chimera,
    dualpipe,
    gpipe,
    interleaved,
    one_f_one_b,
    v_adaptive,
    vshape,
    zb_auto,
    zb_v,
    zero_bubble,
)
