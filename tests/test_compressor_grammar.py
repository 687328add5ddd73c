"""``Compressor(spec)`` reads the scheme strings of the CLI and the README: codec and Compressor options by name."""

import pytest
import torch

import gradcompress


@pytest.mark.parametrize("text, codec, options", [
    ("topk:ratio=0.01,momentum=0.9,warmup_steps=10", "topk:ratio=0.01", {"momentum": 0.9, "warmup_steps": 10}),
    ("int8:server_error_feedback=true,residual_dtype=bfloat16", "int8",
     {"server_error_feedback": True, "residual_dtype": torch.bfloat16}),
    ("randomk:ratio=0.25,scale=false,momentum=0.9", "randomk:ratio=0.25,scale=false", {"momentum": 0.9}),
    ("sign:min_numel=0,seed=3", "sign", {"min_numel": 0, "seed": 3}),
])
def test_options_in_the_string_equal_keywords(text, codec, options):
    assert gradcompress.Compressor(text).config() == gradcompress.Compressor(codec, **options).config()


def test_codec_options_stay_the_codecs():
    c = gradcompress.Compressor("dgc:ratio=0.01,momentum=0.8")  # dgc's own momentum option, not the Compressor's
    assert c.codec.momentum == 0.8 and c.momentum == 0.0


def test_an_option_in_both_places_is_refused():
    with pytest.raises(ValueError, match="momentum.*both"):
        gradcompress.Compressor("topk:ratio=0.01,momentum=0.9", momentum=0.5)


def test_unknown_option_lists_codec_and_compressor_options():
    with pytest.raises(ValueError) as err:
        gradcompress.Compressor("topk:ratio=0.01,momentm=0.9")
    text = str(err.value)
    assert "momentm" in text and "ratio" in text and "warmup_steps" in text and "momentum" in text
