"""Runs torchtitan 0.3.0 for real on CPU (gloo) for the tests: local assets and a torchrun launch.

Nothing is downloaded. :func:`build_assets` writes, into one folder,

* ``tokenizer/``: a byte-level BPE (``tokenizers``) trained on the docstrings of Python's own standard library, in
  the layout torchtitan's ``HuggingFaceTokenizer`` reads from ``--hf_assets_path`` (``tokenizer.json`` and
  ``tokenizer_config.json`` naming the BOS/EOS tokens);
* ``text/data.json``: the same docstrings, one JSON line ``{"text": ...}`` each, the layout of torchtitan's
  ``c4_test`` dataset (``hf_datasets/text_datasets.py``: ``load_dataset(path, split="train")``), read through
  ``--dataloader.dataset_path``.

:func:`torchrun` starts ``tests/torchtitan_launcher.py`` (the CPU shims, then ``torchtitan.train.main()``) under
``python -m torch.distributed.run``.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

LAUNCHER = Path(__file__).with_name("torchtitan_launcher.py")
VOCAB = 2000  # below the llama3 debug model's 2048 embeddings
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def stdlib_docstrings(limit: int = 6000) -> list[str]:
    """Docstrings (at least 200 characters) of the standard library's top-level modules, their classes and
    functions, in a fixed order: the text torchtitan trains on here."""
    found: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    found.append(doc)
        if len(found) >= limit:
            break
    return found[:limit]


def write_tokenizer(texts: list[str], folder: Path) -> None:
    """A byte-level BPE of ``VOCAB`` tokens trained on ``texts``, saved where ``--hf_assets_path`` reads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@dataclass(frozen=True)
class Assets:
    """Where :func:`build_assets` put the tokenizer (``--hf_assets_path``) and the text
    (``--dataloader.dataset_path``)."""

    tokenizer: Path
    text: Path


def build_assets(root: Path) -> Assets:
    """Write the tokenizer and the text under ``root`` (once: an existing build is reused)."""
    assets = Assets(root / "tokenizer", root / "text")
    if (assets.text / "data.json").exists():
        return assets
    texts = stdlib_docstrings()
    write_tokenizer(texts, assets.tokenizer)
    assets.text.mkdir(parents=True, exist_ok=True)
    tmp = assets.text / "data.json.tmp"
    tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    tmp.rename(assets.text / "data.json")
    return assets


def small_run_args(assets: Assets, dump: Path, steps: int) -> list[str]:
    """torchtitan options of a short CPU run of a debug config: local assets, seq_len 128, no CUDA graphs, no
    checkpoints, no validation (its dataset would be downloaded), a log line every step, a fixed seed (torchtitan
    draws one per run otherwise), and the ``partial_dtensor`` SPMD backend: with torch 2.13.0, torchtitan's
    default ``spmd_types`` fails in ``fully_shard`` ("When dp_mesh_dims is provided, all parameters must be
    DTensors", ``torchtitan/models/llama3/parallelize.py:80`` -> ``distributed/fsdp.py:195``) on any device."""
    return ["--hf_assets_path", str(assets.tokenizer), "--dataloader.dataset_path", str(assets.text),
            "--dump_folder", str(dump), "--training.steps", str(steps), "--training.seq_len", "128",
            "--training.local_batch_size", "4", "--training.disable_cuda_graphs",
            "--metrics.log_freq", "1", "--metrics.disable_color_printing", "--checkpoint.no-enable",
            "--validator.no-enable", "--lr_scheduler.warmup_steps", "2",
            "--debug.seed", "0", "--parallelism.spmd_backend", "partial_dtensor"]


@dataclass(frozen=True)
class Run:
    """A finished torchrun: its exit status, its output (stdout and stderr together) and its wall time."""

    returncode: int
    output: str
    seconds: float


def launch(args: list[str], log: Path, nproc: int = 2, params: Path | None = None,
           env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -m torch.distributed.run --nproc_per_node nproc tests/torchtitan_launcher.py *args`` on this
    machine (gloo, one thread per process) in a new session (``os.killpg(proc.pid, ...)`` ends torchrun and its
    workers), its output written to ``log``; ``params``: each rank saves its local parameters there at the end
    (``rank<r>.pt``); ``env``: more environment variables."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **(env or {})}
    if params is not None:
        params.mkdir(parents=True, exist_ok=True)
        full["TORCHTITAN_TEST_PARAMS"] = str(params)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", str(LAUNCHER), *args]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, env=full, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, log: Path, timeout: float, started: float) -> Run:
    """Wait for ``proc`` (:func:`launch`); past ``timeout`` seconds its whole process group is killed and
    ``subprocess.TimeoutExpired`` raised."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return Run(proc.returncode, log.read_text(), time.monotonic() - started)


def torchrun(args: list[str], log: Path, nproc: int = 2, timeout: float = 300, params: Path | None = None) -> Run:
    """:func:`launch`, then :func:`finish`: the finished run, killed (``subprocess.TimeoutExpired``) past
    ``timeout`` seconds."""
    start = time.monotonic()
    return finish(launch(args, log, nproc, params), log, timeout, start)
