"""The relaunch wrapper's output filter: Hydra's BAD TERMINATION banner goes, everything else streams."""

import pytest

from pipeinfer_cli.transport.launch import BannerFilter

BANNER = b"""
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 30425 RUNNING AT vm
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
===================================================================================
YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)
This typically refers to a problem with your application.
Please see the FAQ page for debugging suggestions
"""


def filtered(data: bytes, step: int) -> tuple[bytes, BannerFilter]:
    f = BannerFilter()
    out = b"".join(f.feed(data[i:i + step]) for i in range(0, len(data), step))
    return out + f.close(), f


@pytest.mark.parametrize("step", [1, 2, 5, 64, 1 << 16])
@pytest.mark.parametrize("data, want", [
    (b" Paris. The", b" Paris. The"),
    (b"Paris.\n\nThe end\n\n", b"Paris.\n\nThe end\n\n"),
    (b"a = 1\n==> x\n=\n=====\nPlease note\nThis typically\nYOUR APP", b"a = 1\n==> x\n=\n=====\nPlease note\nThis typically\nYOUR APP"),
    # Text that looks like parts of the banner stays: only the whole banner goes.
    (b"Title\n" + b"=" * 40 + b"\n\n" + b"=" * 40 + b"\n" + b"=" * 40 + b"\n=   BAD\nPlease see the FAQ page for debugging suggestions\n",
     b"Title\n" + b"=" * 40 + b"\n\n" + b"=" * 40 + b"\n" + b"=" * 40 + b"\n=   BAD\nPlease see the FAQ page for debugging suggestions\n"),
    (b"x" + BANNER + b"after\n", b"x\nafter\n"),
    (b"x\n" + BANNER + BANNER + b"\n\n", b"x\n\n\n"),
    (BANNER, b""),
    (b"|partial" + BANNER, b"|partial\n"),
    (b"Error: rank 1: boom\n" + BANNER, b"Error: rank 1: boom\n"),
])
def test_banner_is_removed_and_text_kept(data, want, step):
    out, f = filtered(data, step)
    assert out == want
    if BANNER in data:
        assert f.exit_string == "Killed (signal 9)"


def test_text_is_not_held_back():
    f = BannerFilter()
    assert f.feed(b" Paris") == b" Paris"  # a streamed token is written at once
    assert f.feed(b".\nThe") == b".\nThe"
    assert f.feed(b"\n=") == b"\n"  # only a possible banner line waits for its end
    assert f.feed(b"> x") == b"=> x"
    assert f.feed(b"\n" + b"=" * 30) == b"\n"
    assert f.feed(b"\nok") == b"=" * 30 + b"\nok"
