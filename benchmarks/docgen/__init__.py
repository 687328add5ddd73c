"""The pieces of ``benchmarks/document.py``, which writes BENCHMARKS.md from ``benchmarks/results/*.json`` (split by
section for issue 49; ``python benchmarks/document.py`` is still the command):

- :mod:`.registry`: the results the page expects, ``name -> (command that writes it, minutes, what it needs first)``
- :mod:`.common`: reading result files and formatting numbers, tables, sources and ``not re-measured yet`` lines
- :mod:`.speed`: which scheme at my link, how bytes grow with workers, what compression costs
- :mod:`.accuracy`: what it keeps of accuracy, FSDP and HSDP, nodes
- :mod:`.autopilot`: the autopilot's tables
- :mod:`.faults`: faults under torchft
- :mod:`.diloco`: DiLoCo, below 1/1000 of DDP's bytes, torchtitan, a second model size, time to loss
- :mod:`.summary`: the summary at the top of the page
- :mod:`.plan`: does ``plan`` predict the step, and how these tables are made
"""
