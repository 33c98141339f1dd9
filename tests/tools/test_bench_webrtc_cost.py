"""`turboserve bench webrtc-cost`: one viewer's encode cost, end to end on a small frame."""

from __future__ import annotations

from tools.cli import main


def test_prints_a_row_per_content_and_codec(capsys):
    assert main(["bench", "webrtc-cost", "--size", "64x96", "--seconds", "0.5"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert {(r[0], r[1]) for r in rows} == {
        (content, codec)
        for content in ("smooth", "textured")
        for codec in ("vp8", "h264", "h264-pass")
    }
    for row in rows:
        cpu_ms_per_s, kbit_per_s = float(row[4]), float(row[7])
        assert cpu_ms_per_s > 0 and kbit_per_s > 0


def test_a_bad_size_is_one_line(capsys):
    assert main(["bench", "webrtc-cost", "--size", "big"]) == 2
    assert capsys.readouterr().err.strip() == (
        "turboserve bench webrtc-cost: --size must be HEIGHTxWIDTH, got 'big'"
    )
