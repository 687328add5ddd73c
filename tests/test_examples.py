"""examples/ddp.py as a user meets it: the ``torchrun`` command of its docstring (the one the README shows), run
as written on 2 CPU processes with ``--max-steps``, and rank 0's summary read back from its output."""

import os
import re
import shlex
import subprocess
import sys

from gradcompress.testbed.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "ddp.py")
COMMAND = "torchrun --nproc_per_node 2 examples/ddp.py"


def test_the_command_is_the_one_the_docstring_and_the_readme_show():
    assert re.search(rf"^\s*{re.escape(COMMAND)}\s*(#|$)", open(SCRIPT).read(), re.M)
    assert COMMAND in open(os.path.join(ROOT, "README.md")).read()


def test_ddp_example_trains_and_reports_what_was_sent():
    # torchrun is torch.distributed.run of this interpreter; its port from the environment (PET_MASTER_PORT), so the
    # command's own words stay as the user types them and parallel runs do not meet on 29500
    cmd = [sys.executable, "-m", "torch.distributed.run", *shlex.split(COMMAND)[1:], "--max-steps", "10"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PET_MASTER_PORT=str(free_port()))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert len(re.findall(r"^epoch 0: loss \d+\.\d+", out, re.M)) == 1, out  # rank 0 alone prints
    assert re.search(r"^held-out accuracy 0\.\d{3}$", out, re.M), out
    sent = re.search(r"^sent: int8, 10 steps, ([\d.]+) MB from rank 0 against ([\d.]+) MB by DDP's all-reduce: "
                     r"([\d.]+)x fewer bytes$", out, re.M)
    assert sent, out
    wire, ddp, fewer = map(float, sent.groups())
    assert 0 < wire < ddp and 3.0 < fewer < 4.1, out  # int8: a quarter of fp32 plus scales, dense biases
    assert re.search(r"^int8\S*: chosen by the user$", out, re.M), out
