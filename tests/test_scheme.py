"""The scheme grammar (:mod:`gradcompress.scheme`): one parser for the CLI, netbench, plan and the cost model.

``ACCEPTED`` was recorded from the parsing functions as they were before this module existed
(``cli.task.check_scheme`` / ``split_scheme`` / ``RunConfig``, on main at 03386ac): every string
the CLI accepted must keep its meaning exactly.
"""

from __future__ import annotations

import json
import inspect
import subprocess
import sys

import pytest
import torch

import gradcompress
from gradcompress import costmodel as cm
from gradcompress import scheme as sc
from gradcompress.cli import schemes, task
from gradcompress.testbed import netbench

#: (scheme, check_scheme's canonical text, codec spec, Compressor options, DiLoCo H (0: none), trains with Adam)
ACCEPTED = [
    (' int8 ', 'int8:bucket=512,stochastic=false', 'int8:bucket=512,stochastic=false', {}, 0, False),
    ('bf16', 'bf16', 'bf16', {}, 0, False),
    ('dgc', 'dgc:ratio=0.01,sample=0.01,momentum=0.9,masking=true,clip=0.0,warmup_steps=0', 'dgc:ratio=0.01,sample=0.01,momentum=0.9,masking=true,clip=0.0,warmup_steps=0', {}, 0, False),
    ('dgc:momentum=0.9', 'dgc:ratio=0.01,sample=0.01,momentum=0.9,masking=true,clip=0.0,warmup_steps=0', 'dgc:ratio=0.01,sample=0.01,momentum=0.9,masking=true,clip=0.0,warmup_steps=0', {}, 0, False),
    ('dgc:momentum=0.9,diloco=3', 'dgc:ratio=0.01,sample=0.01,momentum=0.9,masking=true,clip=0.0,warmup_steps=0,diloco=3', 'dgc:ratio=0.01,sample=0.01,momentum=0.9,masking=true,clip=0.0,warmup_steps=0', {}, 3, False),
    ('dgc:ratio=0.01', 'dgc:ratio=0.01,sample=0.01,momentum=0.9,masking=true,clip=0.0,warmup_steps=0', 'dgc:ratio=0.01,sample=0.01,momentum=0.9,masking=true,clip=0.0,warmup_steps=0', {}, 0, False),
    ('fp16', 'fp16', 'fp16', {}, 0, False),
    ('fp16:compressed_adam=true', 'fp16:compressed_adam=true', 'fp16', {}, 0, True),
    ('int4', 'int4:bucket=512,stochastic=false', 'int4:bucket=512,stochastic=false', {}, 0, False),
    ('int4:diloco=25', 'int4:bucket=512,stochastic=false,diloco=25', 'int4:bucket=512,stochastic=false', {}, 25, False),
    ('int4:diloco=25,compressed_adam=false', 'int4:bucket=512,stochastic=false,diloco=25', 'int4:bucket=512,stochastic=false', {}, 25, False),
    ('int4:diloco=25,momentum=0.9', 'int4:bucket=512,stochastic=false,momentum=0.9,diloco=25', 'int4:bucket=512,stochastic=false', {'momentum': 0.9}, 25, False),
    ('int4:diloco=4', 'int4:bucket=512,stochastic=false,diloco=4', 'int4:bucket=512,stochastic=false', {}, 4, False),
    ('int4:momentum=0.9,diloco=5', 'int4:bucket=512,stochastic=false,momentum=0.9,diloco=5', 'int4:bucket=512,stochastic=false', {'momentum': 0.9}, 5, False),
    ('int8', 'int8:bucket=512,stochastic=false', 'int8:bucket=512,stochastic=false', {}, 0, False),
    ('int8:compressed_adam=true', 'int8:bucket=512,stochastic=false,compressed_adam=true', 'int8:bucket=512,stochastic=false', {}, 0, True),
    ('int8:diloco=3,error_feedback=false', 'int8:bucket=512,stochastic=false,error_feedback=false,diloco=3', 'int8:bucket=512,stochastic=false', {'error_feedback': False}, 3, False),
    ('int8:schedule=exp', 'int8:bucket=512,stochastic=false,schedule=exp', 'int8:bucket=512,stochastic=false', {'schedule': 'exp'}, 0, False),
    ('int8:stochastic=true', 'int8:bucket=512,stochastic=true', 'int8:bucket=512,stochastic=true', {}, 0, False),
    ('none', 'none', 'none', {}, 0, False),
    ('none:diloco=2', 'none:diloco=2', 'none', {}, 2, False),
    ('powersgd', 'powersgd:rank=1,alternate=false,min_compression_rate=2.0', 'powersgd:rank=1,alternate=false,min_compression_rate=2.0', {}, 0, False),
    ('powersgd:rank=1', 'powersgd:rank=1,alternate=false,min_compression_rate=2.0', 'powersgd:rank=1,alternate=false,min_compression_rate=2.0', {}, 0, False),
    ('powersgd:rank=16', 'powersgd:rank=16,alternate=false,min_compression_rate=2.0', 'powersgd:rank=16,alternate=false,min_compression_rate=2.0', {}, 0, False),
    ('powersgd:rank=2', 'powersgd:rank=2,alternate=false,min_compression_rate=2.0', 'powersgd:rank=2,alternate=false,min_compression_rate=2.0', {}, 0, False),
    ('powersgd:rank=4', 'powersgd:rank=4,alternate=false,min_compression_rate=2.0', 'powersgd:rank=4,alternate=false,min_compression_rate=2.0', {}, 0, False),
    ('powersgd:rank=4,compressed_adam=true', 'powersgd:rank=4,alternate=false,min_compression_rate=2.0,compressed_adam=true', 'powersgd:rank=4,alternate=false,min_compression_rate=2.0', {}, 0, True),
    ('powersgd:rank=4,momentum=0.9', 'powersgd:rank=4,alternate=false,min_compression_rate=2.0,momentum=0.9', 'powersgd:rank=4,alternate=false,min_compression_rate=2.0', {'momentum': 0.9}, 0, False),
    ('qsgd', 'qsgd:levels=7,bucket=512', 'qsgd:levels=7,bucket=512', {}, 0, False),
    ('qsgd:levels=4,error_feedback=true', 'qsgd:levels=4,bucket=512,error_feedback=true', 'qsgd:levels=4,bucket=512', {'error_feedback': True}, 0, False),
    ('randomk', 'randomk:ratio=0.01,scale=false', 'randomk:ratio=0.01,scale=false', {}, 0, False),
    ('randomk:ratio=0.25,momentum=0.9', 'randomk:ratio=0.25,scale=false,momentum=0.9', 'randomk:ratio=0.25,scale=false', {'momentum': 0.9}, 0, False),
    ('randomk:ratio=0.25,scale=false,momentum=0.9', 'randomk:ratio=0.25,scale=false,momentum=0.9', 'randomk:ratio=0.25,scale=false', {'momentum': 0.9}, 0, False),
    ('randomk:scale=true', 'randomk:ratio=0.01,scale=true', 'randomk:ratio=0.01,scale=true', {}, 0, False),
    ('sign', 'sign:bucket=512', 'sign:bucket=512', {}, 0, False),
    ('sign:compressed_adam=true', 'sign:bucket=512,compressed_adam=true', 'sign:bucket=512', {}, 0, True),
    ('sign:error_feedback=auto', 'sign:bucket=512,error_feedback=auto', 'sign:bucket=512', {'error_feedback': 'auto'}, 0, False),
    ('sign:error_feedback=true', 'sign:bucket=512,error_feedback=true', 'sign:bucket=512', {'error_feedback': True}, 0, False),
    ('sign:momentum=0.9', 'sign:bucket=512,momentum=0.9', 'sign:bucket=512', {'momentum': 0.9}, 0, False),
    ('sign:momentum=0.9,server_error_feedback=true', 'sign:bucket=512,momentum=0.9,server_error_feedback=true', 'sign:bucket=512', {'momentum': 0.9, 'server_error_feedback': True}, 0, False),
    ('terngrad', 'terngrad:bucket=512', 'terngrad:bucket=512', {}, 0, False),
    ('terngrad:error_feedback=true', 'terngrad:bucket=512,error_feedback=true', 'terngrad:bucket=512', {'error_feedback': True}, 0, False),
    ('topk', 'topk:ratio=0.01', 'topk:ratio=0.01', {}, 0, False),
    ('topk :ratio=0.01', 'topk:ratio=0.01', 'topk:ratio=0.01', {}, 0, False),
    ('topk: ratio = 0.01 , momentum = 0.9', 'topk:ratio=0.01,momentum=0.9', 'topk:ratio=0.01', {'momentum': 0.9}, 0, False),
    ('topk:compressed_adam=false', 'topk:ratio=0.01', 'topk:ratio=0.01', {}, 0, False),
    ('topk:compressed_adam=false,diloco=4', 'topk:ratio=0.01,diloco=4', 'topk:ratio=0.01', {}, 4, False),
    ('topk:ratio=0.01', 'topk:ratio=0.01', 'topk:ratio=0.01', {}, 0, False),
    ('topk:ratio=0.01,compressed_adam=true', 'topk:ratio=0.01,compressed_adam=true', 'topk:ratio=0.01', {}, 0, True),
    ('topk:ratio=0.01,min_numel=40000', 'topk:ratio=0.01,min_numel=40000', 'topk:ratio=0.01', {'min_numel': 40000}, 0, False),
    ('topk:ratio=0.01,values=int8', 'topk:values=int8,ratio=0.01', 'topk:values=int8,ratio=0.01', {}, 0, False),
    ('topk:ratio=0.01,values=int8,compressed_adam=true', 'topk:values=int8,ratio=0.01,compressed_adam=true', 'topk:values=int8,ratio=0.01', {}, 0, True),
    ('topk:ratio=0.01,values=int8,diloco=10', 'topk:values=int8,ratio=0.01,diloco=10', 'topk:values=int8,ratio=0.01', {}, 10, False),
    ('topk:ratio=0.01,values={int8:bucket=128,stochastic=true},momentum=0.9', 'topk:values={int8:bucket=128,stochastic=true},ratio=0.01,momentum=0.9', 'topk:values={int8:bucket=128,stochastic=true},ratio=0.01', {'momentum': 0.9}, 0, False),
    ('topk:ratio=0.05,values=int8,compressed_adam=true', 'topk:values=int8,ratio=0.05,compressed_adam=true', 'topk:values=int8,ratio=0.05', {}, 0, True),
    ('topk:schedule=exp,ramp_steps=100', 'topk:ratio=0.01,schedule=exp,ramp_steps=100', 'topk:ratio=0.01', {'ramp_steps': 100, 'schedule': 'exp'}, 0, False),
    ('topk:values=int8', 'topk:values=int8,ratio=0.01', 'topk:values=int8,ratio=0.01', {}, 0, False),
    ('topk:values={int8:bucket=128}', 'topk:values={int8:bucket=128,stochastic=false},ratio=0.01', 'topk:values={int8:bucket=128,stochastic=false},ratio=0.01', {}, 0, False),
]

#: onebitadam schemes: (scheme, canonical text, OneBitAdam options given in the scheme)
ONEBITADAM = [
    ("onebitadam", "onebitadam", {}),
    (" onebitadam ", "onebitadam", {}),
    ("onebitadam:warmup_steps=30", "onebitadam:warmup_steps=30", {"warmup_steps": 30}),
    ("onebitadam:lr=0.001,warmup_steps=10", "onebitadam:lr=0.001,warmup_steps=10", {"lr": 0.001, "warmup_steps": 10}),
    ("onebitadam:eps=1e-6,weight_decay=0.01", "onebitadam:eps=1e-6,weight_decay=0.01",
     {"eps": 1e-6, "weight_decay": 0.01}),
]

BAD_DILOCO = ["0", "-1", "2.5", "abc", "true"]


# --------------------------------------------------------------------------- the same meaning as before
@pytest.mark.parametrize("text, canonical, codec, options, diloco, adam", ACCEPTED)
def test_every_accepted_scheme_keeps_its_meaning(text, canonical, codec, options, diloco, adam):
    s = sc.parse_scheme(text)
    assert s.kind == "ours"
    assert s.text == text.strip()
    assert s.codec.spec == codec
    assert s.compressor == options
    assert (s.diloco or 0) == diloco
    assert s.compressed_adam is adam
    assert s.canonical() == canonical
    assert schemes.check(text) == canonical
    got_codec, got_options = schemes.split_scheme(text)
    assert (got_codec.spec, got_options) == (codec, options)
    cfg = task.RunConfig(scheme=text)
    assert cfg.diloco == diloco and (cfg.kind() == task.ONEBITADAM) is adam
    cost = cm.parse_scheme(text)
    assert (cost.kind, cost.codec.spec, dict(cost.options)) == ("ours", codec, options)


@pytest.mark.parametrize("text, canonical, options", ONEBITADAM)
def test_onebitadam_schemes_keep_their_meaning(text, canonical, options):
    s = sc.parse_scheme(text)
    assert (s.kind, s.codec, s.adam, s.canonical()) == ("onebitadam", None, options, canonical)
    assert schemes.check(text) == canonical
    cfg = task.RunConfig(scheme=text)
    assert cfg.kind() == task.ONEBITADAM
    assert cfg.onebitadam_options() == {"lr": 0.001, "warmup_steps": 60, **options}


@pytest.mark.parametrize("text, kind, rank", [("ddp", "ddp", 1), ("torch-fp16", "torch-fp16", 1),
                                              ("torch-powersgd", "torch-powersgd", 1),
                                              (" torch-powersgd:rank=4 ", "torch-powersgd", 4)])
def test_pytorch_baselines(text, kind, rank):
    s = sc.parse_scheme(text)
    assert (s.text, s.kind, s.codec, s.rank, s.options) == (text.strip(), kind, None, rank, ())
    assert cm.parse_scheme(text) == s
    assert schemes.check_schemes([text]) == [text.strip()]


def test_run_config_reads_the_scheme_as_before():
    """What demo and train derive from a scheme (recorded before the change)."""
    cfg = task.RunConfig(scheme="int4:diloco=25")
    assert cfg.optimizer_text() == "DiLoCo(H=25, outer SGD lr 0.7 Nesterov 0.9) over SGD(lr=0.05, momentum=0.9)"
    codec, options = task.RunConfig(scheme="topk: ratio = 0.01 , momentum = 0.9").compressor()
    assert codec.spec == "topk:ratio=0.01"
    assert options == {"momentum": 0.9, "error_feedback": "auto", "min_numel": 1024, "warmup_steps": 5,
                       "seed": 0, "monitor_every": 0}
    cadam = task.RunConfig(scheme="topk:ratio=0.01,values=int8,compressed_adam=true")
    assert cadam.onebitadam_options() == {"codec": "topk:values=int8,ratio=0.01",
                                          "lr": 0.001, "warmup_steps": 60}
    assert task.RunConfig(scheme="dgc:momentum=0.9").momentum_corrected()
    assert not task.RunConfig(scheme="int8:schedule=exp").momentum_corrected()


def test_options_keep_the_order_given():
    s = sc.parse_scheme("topk:schedule=exp,ramp_steps=100")
    assert s.options == (("schedule", "exp"), ("ramp_steps", 100))
    assert s.canonical() == "topk:ratio=0.01,schedule=exp,ramp_steps=100"
    assert sc.parse_scheme("topk:compressed_adam=false,diloco=4").canonical() == "topk:ratio=0.01,diloco=4"


# --------------------------------------------------------------------------- errors
def test_unknown_option_lists_codec_compressor_and_scheme_options():
    with pytest.raises(ValueError) as err:
        sc.parse_scheme("topk:ratio=0.01,warmup_steps=10")
    msg = str(err.value)
    assert msg.startswith("topk: unknown option 'warmup_steps'; options of topk: values, ratio, chunk; ")
    assert "Compressor options: " + ", ".join(sc.SCHEME_COMPRESSOR_OPTIONS) in msg
    assert msg.endswith("scheme options: diloco, compressed_adam, outer, outer_lr, fragments, delay, mix, inner")


@pytest.mark.parametrize("value", BAD_DILOCO)
def test_bad_diloco_is_the_same_error_everywhere(value):
    text = f"int4:diloco={value}"
    with pytest.raises(ValueError, match=r"diloco must be an integer >= 1 \(inner steps per sync\)"):
        sc.parse_scheme(text)
    with pytest.raises(ValueError, match="diloco must be an integer >= 1"):
        cm.parse_scheme(text)
    for call in (lambda: schemes.check(text), lambda: task.RunConfig(scheme=text),
                 lambda: schemes.check_schemes([text]), lambda: schemes.check_schemes([text], fsdp=True)):
        with pytest.raises(task.CLIError, match="diloco must be an integer >= 1"):
            call()


def test_netbench_takes_diloco_schemes_and_rejects_what_it_cannot_run():
    assert schemes.check_schemes(["int4:diloco=25", " ddp"]) == ["int4:diloco=25", "ddp"]
    assert netbench._diloco_h("int4:diloco=25") == 25 and netbench._diloco_h("int4") == 0
    assert netbench._diloco_h(netbench.FSDP_BASELINE) == 0
    for text, needle in [("ddp:diloco=5", "ddp takes no options"), ("onebitadam", "unknown scheme 'onebitadam'"),
                         ("topk:ratio=0.01,compressed_adam=true", "netbench does not run"),
                         ("nosuch", "unknown scheme 'nosuch'")]:
        with pytest.raises(task.CLIError, match=needle):
            schemes.check_schemes([text])
    with pytest.raises(task.CLIError, match="do not combine with --fsdp"):
        schemes.check_schemes(["int4:diloco=4"], fsdp=True)
    # the time-to-loss comparison times DeMo and SparseLoCo on the testbed too
    taken = ["decoupled:lr=0.01", "none:diloco=50,outer=sparseloco", "int2:diloco=100,inner=muon"]
    assert schemes.check_schemes(taken) == taken
    assert netbench._decoupled("decoupled:lr=0.01") and not netbench._decoupled("int4:diloco=25")
    with pytest.raises(task.CLIError, match="--fsdp does not apply to decoupled"):
        schemes.check_schemes(["decoupled"], fsdp=True)


@pytest.mark.parametrize("text, needle", [
    ("topk:compressed_adam=1", "compressed_adam must be true or false, got 1"),
    ("topk:compressed_adam=true,momentum=0.9", "the option(s) momentum do not apply"),
    ("topk:compressed_adam=true,diloco=3", "the option(s) diloco do not apply"),
    ("dgc:compressed_adam=true", "dgc keeps its own momentum; use topk"),
    ("sign:error_feedback=maybe", "error_feedback must be true, false or auto, got 'maybe'"),
    ("onebitadam:foo=1", "onebitadam: unknown option 'foo'; options of onebitadam: lr, warmup_steps, weight_decay, eps, sync_every, sync_ramp_steps"),
    ("onebitadam:lr=abc", "onebitadam: lr must be a number, got 'abc'"),
    ("onebitadam:diloco=3", "onebitadam: unknown option 'diloco'"),
    ("torch-powersgd:rank=0", "torch-powersgd takes one option, rank (an integer >= 1)"),
    ("ddp:x=1", "ddp takes no options"),
    ("nosuch", "unknown codec 'nosuch'; available codecs: "),
])
def test_bad_schemes_say_what_is_wrong(text, needle):
    with pytest.raises(ValueError) as err:
        sc.parse_scheme(text)
    assert needle in str(err.value)


def test_cli_names_pytorch_baselines_unknown_schemes():
    for text in ("ddp", "ddp:x=1", "torch-powersgd:rank=2"):
        with pytest.raises(task.CLIError, match=f"unknown scheme '{text.partition(':')[0]}'; valid schemes: "):
            schemes.check(text)


# --------------------------------------------------------------------------- Compressor(spec)'s grammar
def test_compressor_options_are_the_compressors_keywords():
    params = inspect.signature(gradcompress.Compressor.__init__).parameters
    # the keywords that take objects (a group, a callable, state mappings) are not options of a spec string
    keywords = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY} - {
        "process_group", "divisor", "slots", "coordinator"}
    assert set(sc.COMPRESSOR_OPTIONS) == keywords
    assert set(sc.SCHEME_COMPRESSOR_OPTIONS) < set(sc.COMPRESSOR_OPTIONS)


def test_split_compressor_options_reads_the_readme_strings():
    spec, options = sc.split_compressor_options("topk:ratio=0.01,momentum=0.9,warmup_steps=10")
    assert (spec, options) == ("topk:ratio=0.01", {"momentum": 0.9, "warmup_steps": 10})
    assert sc.split_compressor_options("sign:momentum=0.9,server_error_feedback=true") == \
        ("sign:bucket=512", {"momentum": 0.9, "server_error_feedback": True})
    assert sc.split_compressor_options("topk:ratio=0.01,min_numel=40000")[1] == {"min_numel": 40000}
    assert sc.split_compressor_options("qsgd:levels=4,error_feedback=true")[1] == {"error_feedback": True}
    assert sc.split_compressor_options("int8:seed=3,monitor_every=100")[1] == {"seed": 3, "monitor_every": 100}
    for removed in ("collective=allgather", "overlap=false"):  # options removed (docs/usage.md)
        with pytest.raises(ValueError, match=removed.split("=")[0]):
            sc.split_compressor_options(f"int8:{removed}")
    assert sc.split_compressor_options({"name": "topk", "ratio": 0.05, "momentum": 0.5}) == \
        ("topk:ratio=0.05", {"momentum": 0.5})


def test_split_compressor_options_converts_residual_dtype():
    assert sc.split_compressor_options("topk:residual_dtype=bfloat16")[1] == {"residual_dtype": torch.bfloat16}
    assert sc.split_compressor_options("int8:residual_dtype=float16")[1] == {"residual_dtype": torch.float16}
    with pytest.raises(ValueError, match="residual_dtype must be one of float32, bfloat16, float16, got 'int8'"):
        sc.split_compressor_options("topk:residual_dtype=int8")


def test_codec_options_stay_the_codecs():
    """dgc has its own momentum and warm-up: in a dgc spec they are the codec's, not the Compressor's."""
    spec, options = sc.split_compressor_options("dgc:momentum=0.5,warmup_steps=3,seed=2")
    assert options == {"seed": 2}
    codec = gradcompress.make(spec)
    assert (codec.momentum, codec.warmup_steps) == (0.5, 3)


def test_split_compressor_options_builds_the_same_compressor_as_keywords():
    spec, options = sc.split_compressor_options("topk:ratio=0.01,momentum=0.9,warmup_steps=10,residual_dtype=bfloat16")
    a = gradcompress.Compressor(spec, **options)
    b = gradcompress.Compressor("topk:ratio=0.01", momentum=0.9, warmup_steps=10, residual_dtype=torch.bfloat16)
    assert a.config() == b.config()


def test_split_compressor_options_unknown_option_lists_codec_and_compressor_options():
    with pytest.raises(ValueError) as err:
        sc.split_compressor_options("topk:ratio=0.01,diloco=5")
    msg = str(err.value)
    assert msg == ("topk: unknown option 'diloco'; options of topk: values, ratio, chunk; Compressor options: "
                   + ", ".join(sc.COMPRESSOR_OPTIONS))
    with pytest.raises(ValueError, match="options of fp16: none; Compressor options: error_feedback"):
        sc.split_compressor_options("fp16:bucket=4")
    with pytest.raises(ValueError, match="needs a 'name' key"):
        sc.split_compressor_options({"ratio": 0.1})


def test_merge_compressor_options_refuses_an_option_given_twice():
    assert sc.merge_compressor_options({"momentum": 0.9}, {"seed": 1}) == {"momentum": 0.9, "seed": 1}
    with pytest.raises(ValueError, match=r"Compressor: momentum is given both in the spec \('topk:momentum=0.9'\) "
                                         "and as a keyword; set it in one place"):
        sc.merge_compressor_options({"momentum": 0.9}, {"momentum": 0.5}, "topk:momentum=0.9")


# --------------------------------------------------------------------------- layering
LIBRARY_MODULES = ["gradcompress.costmodel", "gradcompress.scheme", "gradcompress.factory", "gradcompress.testbed.hosts",
                   "gradcompress.testbed.launch", "gradcompress.testbed.netbench"]


@pytest.fixture(scope="module")
def cli_imported_by() -> dict[str, list[str]]:
    """For each of LIBRARY_MODULES, the ``gradcompress.cli`` modules in ``sys.modules`` once it is imported, each
    in a fresh process: one interpreter imports torch, then forks a child per module that imports it and reports."""
    code = f"""if True:
        import json, os, sys, torch
        for module in {LIBRARY_MODULES!r}:
            pid = os.fork()
            if pid == 0:
                __import__(module)
                print(json.dumps([module, sorted(m for m in sys.modules if m.startswith("gradcompress.cli"))]),
                      flush=True)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            if status:
                sys.exit(f"importing {{module}} failed: {{status}}")
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(json.loads(line) for line in proc.stdout.splitlines())


@pytest.mark.parametrize("module", LIBRARY_MODULES)
def test_library_modules_do_not_import_the_cli(cli_imported_by, module):
    assert cli_imported_by[module] == []


# --------------------------------------------------------------------------- the testbed's files
def test_testbed_result_and_log_tail(tmp_path):
    from gradcompress.testbed import hosts

    cfg = {"out": str(tmp_path / "rank0.json")}
    hosts.write_result(cfg, {"rank": 0, "schemes": [1, 2]})
    assert hosts._read_json(cfg["out"]) == {"rank": 0, "schemes": [1, 2]}
    assert not (tmp_path / "rank0.json.part").exists()
    (tmp_path / "rank1.log").write_text("".join(f"line {i}\n" for i in range(50)))
    assert hosts.log_tail(str(tmp_path), 1, lines=3) == "line 47\nline 48\nline 49"
    assert hosts.log_tail(str(tmp_path), 2) == ""
