"""The text form round-trips: parse(render(program)) == program."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipec.codegen.render import render_program
from pipec.ir import Instr, Op, PipecError
from pipec.textform import Header, parse_program

small = st.one_of(st.none(), st.integers(0, 10_000))
instrs = st.builds(Instr, st.sampled_from(list(Op)), small, small, small)
headers = st.builds(
    Header,
    st.just(1),
    st.integers(0, 999),
    st.integers(1, 1000),
    st.sampled_from(["1f1b", "v-half", "zb-h1"]),
    st.integers(1, 64),
    st.integers(1, 1024),
    st.integers(1, 8),
    st.text("0123456789abcdef", min_size=16, max_size=16),
)


@given(headers, st.lists(instrs, max_size=50).map(tuple))
def test_parse_render_roundtrip(header, program):
    assert parse_program(render_program(header, program)) == (header, program)


def test_corrupt_line_names_file_and_line():
    text = render_program(Header(1, 0, 2, "1f1b", 2, 2, 1, "0" * 16), (Instr(Op.F, 0, 0),))
    with pytest.raises(PipecError, match=r"x.pipe:3: not an instruction: 'F s=0 mb='"):
        parse_program(text.replace("mb=0", "mb="), "x.pipe")
    with pytest.raises(PipecError, match=r"x.pipe:3: .*SEND_ACT takes to="):
        parse_program(text.replace("F s=0 mb=0", "SEND_ACT s=0 mb=0 from=1"), "x.pipe")
    with pytest.raises(PipecError, match="not a pipec program"):
        parse_program("", "x.pipe")
