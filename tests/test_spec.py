"""Codec specs: parsing, make(), available(), validation errors and canonical spec strings."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import gradcompress
from gradcompress import Codec, make
from gradcompress.spec import Range, parse

EXPECTED = {"none", "fp16", "bf16", "int8", "int4", "qsgd", "terngrad", "sign",
            "topk", "randomk", "threshold", "dgc", "powersgd"}


# --------------------------------------------------------------------------- available / make
def test_available_is_sorted_and_complete():
    names = gradcompress.available()
    assert names == sorted(names)
    assert len(names) == len(set(names))
    assert EXPECTED <= set(names)
    for name in names:
        codec = make(name)
        assert isinstance(codec, Codec)
        assert codec.name == name


def test_make_from_string_sets_options():
    c = make("topk:ratio=0.25")
    assert c.name == "topk" and c.ratio == 0.25 and c.values is None
    c = make("int8:bucket=64,stochastic=true")
    assert c.bucket == 64 and c.stochastic is True
    c = make("qsgd:levels=4")
    assert c.levels == 4 and isinstance(c.levels, int)
    c = make("randomk:scale=false,ratio=0.5")
    assert c.scale is False and c.ratio == 0.5


def test_make_from_dict():
    c = make({"name": "topk", "ratio": 0.01, "values": {"name": "int8", "bucket": 128}})
    assert c.ratio == 0.01
    assert c.values == make("int8:bucket=128")
    assert make({"name": "qsgd", "levels": 4}) == make("qsgd:levels=4")
    assert make({"name": "fp16"}) == make("fp16")
    # the dict is not modified
    d = {"name": "int4", "bucket": 32}
    make(d)
    assert d == {"name": "int4", "bucket": 32}


def test_make_nested_codec_option():
    c = make("topk:ratio=0.01,values=int8")
    assert c.values == make("int8")
    c = make({"name": "topk", "values": make("int4:bucket=16")})
    assert c.values == make("int4:bucket=16")


def test_make_returns_a_codec_unchanged():
    c = make("int8:bucket=64")
    assert make(c) is c


def test_int_given_to_float_option_is_accepted():
    c = make("topk:ratio=1")
    assert c.ratio == 1.0 and isinstance(c.ratio, float)
    assert make({"name": "topk", "ratio": 1}).ratio == 1.0


def test_whitespace_is_tolerated():
    assert make(" topk : ratio = 0.5 , values = int8 ") == make("topk:ratio=0.5,values=int8")
    assert make("int8:") == make("int8")


def test_codecs_are_immutable_and_comparable():
    c = make("int8:bucket=64")
    assert c == make({"name": "int8", "bucket": 64})
    assert c != make("int8:bucket=65")
    assert hash(c) == hash(make("int8:bucket=64"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.bucket = 3  # frozen


# --------------------------------------------------------------------------- parse
def test_parse_types_values():
    assert parse("x:a=1,b=2.5,c=true,d=FALSE,e=int8,f=-3,g=1e-3") == {
        "name": "x", "a": 1, "b": 2.5, "c": True, "d": False, "e": "int8", "f": -3, "g": 1e-3}
    assert isinstance(parse("x:a=1")["a"], int)
    assert isinstance(parse("x:a=1.0")["a"], float)
    assert parse("name") == {"name": "name"}


@pytest.mark.parametrize("bad", ["topk:ratio", "topk:=0.1", "topk:ratio=0.1,", "topk:ratio=0.1,,values=int8"])
def test_parse_malformed(bad):
    with pytest.raises(ValueError, match="key=value"):
        make(bad)


def test_parse_duplicate_option():
    with pytest.raises(ValueError, match=r"'ratio'.*twice"):
        make("topk:ratio=0.1,ratio=0.2")


@pytest.mark.parametrize("bad", [3, 0.5, None, ["topk"], b"topk"])
def test_spec_of_wrong_type(bad):
    with pytest.raises(ValueError, match="string or a dict"):
        make(bad)


def test_dict_without_name():
    with pytest.raises(ValueError, match="'name'"):
        make({"ratio": 0.1})


# --------------------------------------------------------------------------- errors
def test_unknown_codec_names_available():
    with pytest.raises(ValueError) as info:
        make("nope")
    msg = str(info.value)
    assert "'nope'" in msg
    for name in gradcompress.available():
        assert name in msg
    with pytest.raises(ValueError, match="available codecs"):
        make({"name": "Int8"})
    with pytest.raises(ValueError, match="available codecs"):
        make("")


def test_unknown_option_names_option_and_allowed():
    with pytest.raises(ValueError) as info:
        make("int8:bogus=1")
    msg = str(info.value)
    assert "int8" in msg and "'bogus'" in msg
    assert "bucket" in msg and "stochastic" in msg  # the options that do exist
    with pytest.raises(ValueError, match=r"'levls'.*levels"):
        make({"name": "qsgd", "levls": 3})
    with pytest.raises(ValueError, match="options of fp16: none"):
        make("fp16:bucket=3")


@pytest.mark.parametrize(
    "spec, option, allowed",
    [
        ("topk:ratio=2", "ratio", "(0, 1]"),
        ("topk:ratio=0", "ratio", "(0, 1]"),
        ("topk:ratio=-0.5", "ratio", "(0, 1]"),
        ("topk:ratio=nan", "ratio", "(0, 1]"),
        ("topk:ratio=inf", "ratio", "(0, 1]"),
        ("randomk:ratio=1.5", "ratio", "(0, 1]"),
        ("dgc:ratio=0", "ratio", "(0, 1]"),
        ("dgc:sample=2", "sample", "(0, 1]"),
        ("dgc:momentum=1", "momentum", "[0, 1)"),
        ("dgc:clip=-1", "clip", "[0, inf)"),
        ("dgc:warmup_steps=-1", "warmup_steps", "[0, inf)"),
        ("qsgd:levels=0", "levels", "[1, 32767]"),
        ("qsgd:levels=40000", "levels", "[1, 32767]"),
        ("qsgd:bucket=0", "bucket", "[1, inf)"),
        ("int8:bucket=0", "bucket", "[1, inf)"),
        ("int4:bucket=-5", "bucket", "[1, inf)"),
        ("terngrad:bucket=0", "bucket", "[1, inf)"),
        ("sign:bucket=0", "bucket", "[1, inf)"),
        ("threshold:value=-1", "value", "[0, inf)"),
        ("powersgd:rank=0", "rank", "[1, inf)"),
        ("powersgd:min_compression_rate=0.5", "min_compression_rate", "[1, inf)"),
    ],
)
def test_out_of_range_names_option_and_range(spec, option, allowed):
    with pytest.raises(ValueError) as info:
        make(spec)
    msg = str(info.value)
    assert spec.split(":")[0] in msg
    assert option in msg
    assert allowed in msg
    assert "got" in msg


@pytest.mark.parametrize(
    "spec, option, what",
    [
        ("qsgd:levels=2.5", "levels", "integer"),
        ("qsgd:levels=true", "levels", "integer"),
        ("int8:bucket=abc", "bucket", "integer"),
        ("topk:ratio=abc", "ratio", "number"),
        ("topk:ratio=true", "ratio", "number"),
        ("int8:stochastic=1", "stochastic", "true or false"),
        ("int8:stochastic=yes", "stochastic", "true or false"),
        ("randomk:scale=0.5", "scale", "true or false"),
        ("topk:values=3", "values", "codec"),
    ],
)
def test_wrong_type_names_option(spec, option, what):
    with pytest.raises(ValueError) as info:
        make(spec)
    msg = str(info.value)
    assert option in msg and what in msg


def test_wrong_type_in_dict():
    with pytest.raises(ValueError, match=r"bucket.*integer.*\[1, inf\)"):
        make({"name": "int8", "bucket": 12.0})
    with pytest.raises(ValueError, match=r"stochastic.*true or false"):
        make({"name": "int8", "stochastic": "true"})
    with pytest.raises(ValueError, match=r"ratio.*number.*\(0, 1\]"):
        make({"name": "topk", "ratio": "0.1"})
    with pytest.raises(ValueError, match="values must name a codec"):
        make({"name": "topk", "values": 3.5})


def test_bad_nested_codec():
    with pytest.raises(ValueError, match="unknown codec 'bogus'"):
        make("topk:values=bogus")
    with pytest.raises(ValueError, match=r"int8.*bucket.*\[1, inf\)"):
        make({"name": "topk", "values": {"name": "int8", "bucket": 0}})


def test_direct_construction_is_validated_too():
    cls = type(make("topk"))
    with pytest.raises(ValueError, match=r"ratio.*\(0, 1\]"):
        cls(ratio=3.0)


# --------------------------------------------------------------------------- canonical spec
EXTRA = ["topk:ratio=0.01,values=int8", "int8:stochastic=true", "int4:stochastic=true", "randomk:scale=true",
         "qsgd:levels=4", "dgc:ratio=0.1,masking=false,warmup_steps=3", "powersgd:rank=4,alternate=true"]


@pytest.mark.parametrize("spec", sorted(EXPECTED) + EXTRA)
def test_spec_round_trips(spec):
    c = make(spec)
    assert make(c.spec) == c
    assert make(make(c.spec).spec) == c


def test_nested_spec_round_trips():
    """A nested codec with non-default options is spelled in braces, and make reads it back."""
    c = make({"name": "topk", "ratio": 0.05, "values": {"name": "int8", "bucket": 128, "stochastic": True}})
    assert "{" in c.spec
    assert make(c.spec) == c
    c2 = make({"name": "dgc", "values": {"name": "qsgd", "levels": 3, "bucket": 64}, "ratio": 0.2})
    assert make(c2.spec) == c2


def test_nested_spec_in_braces():
    assert parse("topk:values={int8:bucket=128,stochastic=true},ratio=0.05") == {
        "name": "topk", "values": "int8:bucket=128,stochastic=true", "ratio": 0.05}
    assert make("topk:ratio=0.05,values={int8:bucket=128}") == make(
        {"name": "topk", "ratio": 0.05, "values": {"name": "int8", "bucket": 128}})
    assert make("topk:values={int8}") == make("topk:values=int8")


@pytest.mark.parametrize("bad", ["topk:values={int8:bucket=128", "topk:values=int8}", "topk:values={int8}},ratio=0.1"])
def test_unbalanced_braces(bad):
    with pytest.raises(ValueError, match="braces"):
        make(bad)


# --------------------------------------------------------------------------- Range
def test_range_contains_and_str():
    r = Range(0, 1, lo_open=True)
    assert str(r) == "(0, 1]"
    assert not r.contains(0) and r.contains(1e-9) and r.contains(1) and not r.contains(1.0000001)
    assert not r.contains(float("nan"))
    assert str(Range(1, None)) == "[1, inf)"
    assert str(Range(None, 2.5, hi_open=True)) == "(-inf, 2.5)"
    assert Range(None, None).contains(-1e300)


def test_error_messages_are_single_line_and_name_codec():
    for spec in ("topk:ratio=2", "int8:bogus=1", "qsgd:levels=0", "nope"):
        with pytest.raises(ValueError) as info:
            make(spec)
        msg = str(info.value)
        assert "\n" not in msg
        assert re.search(r"topk|int8|qsgd|nope", msg)


def test_make_does_not_touch_global_rng():
    state = torch.get_rng_state()
    for name in gradcompress.available():
        make(name)
    assert torch.equal(state, torch.get_rng_state())
