"""Link rates as users spell them (issue 48): ``1Gbps`` is 1 Gbit/s everywhere, bytes only with a capital B.

One parser (:func:`gradcompress.timing.parse_rate`) reads every rate: ``--bandwidth`` of netbench and plan, plan's
``--intra-bandwidth``/``--host-limit``, netbench's ``--change``, ftbench's ``--rate`` and ``auto:bandwidth=``; the
testbed hands tc the rate in tc's own ``bit`` (tc reads ``bps`` as bytes per second)."""

from __future__ import annotations

import json
import subprocess

import pytest

import gradcompress
from gradcompress.autospec import parse as parse_auto
from gradcompress.cli import main
from gradcompress.testbed import netns
from gradcompress.timing import parse_rate

G = 1e9


@pytest.mark.parametrize("text, bits", [
    # bits per second, as links are quoted: every spelling of 1 Gbit/s
    ("1Gbps", G), ("1gbps", G), ("1gbit", G), ("1Gbit", G), ("1GBIT", G), ("1G", G), ("1g", G), ("1Gbit/s", G),
    ("1gbit/s", G), ("1Gb/s", G), ("1Gb", G), ("1 Gbit/s", G), ("1e9bit", G), ("1000Mbps", G), ("1000M", G),
    ("100mbit", 100e6), ("100Mbps", 100e6), ("100M", 100e6), ("2.5gbit", 2.5e9), ("500kbit", 500e3),
    ("500Kbps", 500e3), ("10Gbit", 10e9), ("1Tbit", 1e12), ("64bit", 64), ("64bps", 64),
    # bytes per second only with a capital B
    ("125MBps", G), ("125MB/s", G), ("125MB", G), ("1GBps", 8 * G), ("1GB/s", 8 * G), ("100kBps", 800e3),
    ("1Bps", 8),
])
def test_every_spelling_of_a_rate(text, bits):
    assert parse_rate(text) == pytest.approx(bits)


@pytest.mark.parametrize("text", ["", "fast", "100", "1e9", "0mbit", "-1gbit", "1 gigabit", "1Mi", "1MiB/s",
                                  "1xbit", "Gbit", "1ps", "1/s", "1gbitt"])
def test_what_is_not_a_rate(text):
    with pytest.raises(ValueError, match="bad rate .*bits per second.*capital B"):
        parse_rate(text)


def test_auto_bandwidth_reads_the_same():
    assert parse_auto({"bandwidth": "1Gbps"}).bandwidth == pytest.approx(G)
    assert parse_auto({"bandwidth": "125MB/s"}).bandwidth == pytest.approx(G)
    assert gradcompress.Compressor("auto:bandwidth=1Gbps").config().startswith("auto:bandwidth=1Gbit/s,")


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``gradcompress ARGV --help`` through the console script's function (a help text starts nothing)."""
    assert main([*argv, "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("command", ["netbench", "plan"])
def test_bandwidth_help_states_the_rule(capsys, command):
    text = _help(capsys, command)
    assert "bits per second: 1gbit = 1Gbps = 1G = 1Gbit/s" in text, text
    assert "bytes per second only with a capital B (125MBps = 125MB/s = 1 Gbit/s)" in text, text


def test_plan_reads_1gbps_as_1_gigabit(capsys):
    """A new user's `plan --bandwidth 1Gbps`: the link it predicts for is 1 Gbit/s, as 1gbit, not 8 Gbit/s."""
    out = {}
    for spelling in ("1Gbps", "1gbit", "1G", "125MB/s"):
        assert main(["plan", "--params", "1e6", "--workers", "2", "--bandwidth", spelling, "--schemes", "ddp",
                     "--calibration-numel", "4096", "--json"]) == 0
        out[spelling] = json.loads(capsys.readouterr().out)
    assert {o["bandwidth_bit"] for o in out.values()} == {G}
    assert main(["plan", "--params", "1e6", "--workers", "2", "--bandwidth", "1Gbps", "--schemes", "ddp",
                 "--calibration-numel", "4096"]) == 0
    assert "2 workers at 1 Gbit/s" in capsys.readouterr().out


def test_bad_rate_is_one_line_with_the_rule(capsys):
    assert main(["plan", "--params", "1e6", "--workers", "2", "--bandwidth", "1000"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad rate '1000'" in err and "capital B" in err, err


def test_the_tc_command_for_1gbps_shapes_1_gigabit(monkeypatch):
    """The testbed built for --bandwidth 1Gbps hands tc 1000000000bit (tc's 'bps' would be bytes: 8 Gbit/s)."""
    commands: list[list[str]] = []

    def record(cmd, check=True):
        commands.append(list(cmd))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(netns, "_run", record)
    bed = netns.Testbed(2, rate_bit=parse_rate("1Gbps"))
    bed._up()
    shaping = [c for c in commands if c[0] == "tc" and "tbf" in c]
    assert len(shaping) == 4  # each host's egress and its bridge port
    for c in shaping:
        assert c[c.index("rate") + 1] == "1000000000bit", c
    assert netns.tbf(parse_rate("125MBps"))[:3] == ["tbf", "rate", "1000000000bit"]
    assert netns.tc_rate(parse_rate("1Gbps")) == "1000000000bit"
