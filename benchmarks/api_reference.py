"""docs/api.md, written from the public API's docstrings (issue 49).

    python benchmarks/api_reference.py                  # write docs/api.md
    python benchmarks/api_reference.py --check          # exit 1, naming what differs, if docs/api.md is not that
    python benchmarks/api_reference.py --output PATH    # write (or, with --check, compare) PATH instead

The page lists, module by module (:data:`MODULES`), every public name: ``gradcompress.__all__``,
``gradcompress.optim.__all__`` and the integrations' public entry points, each with its signature
(``inspect.signature``) and its docstring, converted from the docstrings' reStructuredText (``Args:``,
``Returns:``, ``Raises:``, ``Example::`` sections, as in PyTorch's ``powerSGD_hook.py``) to Markdown. A class
gets its public methods and properties, those it defines itself, in the order it defines them. The output is
deterministic (no addresses, fixed order): edit the docstrings, then run this script; the test suite runs
``--check`` (``tests/test_api_reference.py``).
"""

from __future__ import annotations

import argparse
import enum
import importlib
import inspect
import os
import re
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUT = os.path.join(ROOT, "docs", "api.md")
HERE = os.path.join(ROOT, "benchmarks")
if HERE not in sys.path:  # imported from elsewhere (run as a script, benchmarks/ is on the path already)
    sys.path.insert(0, HERE)

from docgen.page import write_or_check  # noqa: E402  (benchmarks/ is not a package: on the path above)

#: (module, the names it documents: None for its ``__all__``), in page order; the integrations import their
#: framework (each is an optional dependency, all of them in the ``[test]`` extra)
MODULES: list[tuple[str, list[str] | None]] = [
    ("gradcompress", None),
    ("gradcompress.optim", None),
    ("gradcompress.integrations.torchft", ["managed_compressor", "Compressor", "DistributedDataParallel",
                                           "ManagedCollectives", "Lighthouse"]),
    ("gradcompress.integrations.torchtitan", ["GradcompressConfig", "with_gradcompress"]),
    ("gradcompress.integrations.lightning", ["CompressedDDPStrategy"]),
]

SECTION = re.compile(r"^(Args|Arguments|Returns|Raises|Yields|Attributes|Note|Example|Examples):(:?)\s*$")
ITEM = re.compile(r"^(\*{0,2}[\w.]+)(\s*\([^)]*\))?:\s*(.*)$")
LISTED = ("Args", "Arguments", "Raises", "Attributes")  # sections whose block is a list of ``name: text`` items


# --------------------------------------------------------------------------- what is documented
def public_names(module: Any, names: list[str] | None) -> list[str]:
    """The documented names of ``module``: ``names``, or its ``__all__`` less submodules and constants."""
    chosen = names if names is not None else list(module.__all__)
    return [n for n in chosen if callable(getattr(module, n)) and not inspect.ismodule(getattr(module, n))]


def members(cls: type, documented: frozenset = frozenset()) -> list[tuple[str, Any]]:
    """The public methods and properties ``cls`` defines itself, in definition order, then those it inherits from
    the bases of its own subpackage up to the first ``documented`` one (a shell the page does not document, such
    as ``gradcompress.optim.exchanging.ExchangingOptimizer``: its methods are each subclass's API)."""
    package, owners = cls.__module__.rpartition(".")[0], [cls]
    for base in cls.__mro__[1:]:
        if base in documented or package == "gradcompress" or base.__module__.rpartition(".")[0] != package:
            break
        owners.append(base)
    found, seen = [], set()
    for owner in owners:
        for name, value in vars(owner).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if inspect.isfunction(value) or isinstance(value, property):
                found.append((name, value))
    return found


def entries() -> list[tuple[str, str, Any]]:
    """Every documented object as (module, qualified name, object), page order; methods follow their class."""
    listed = [(module_name, name, getattr(module, name)) for module_name, names in MODULES
              for module in [importlib.import_module(module_name)] for name in public_names(module, names)]
    documented = frozenset(obj for _, _, obj in listed if inspect.isclass(obj))
    found = []
    for module_name, name, obj in listed:
        found.append((module_name, name, obj))
        if inspect.isclass(obj) and not issubclass(obj, enum.Enum):
            found += [(module_name, f"{name}.{m}", v) for m, v in members(obj, documented)]
    return found


# --------------------------------------------------------------------------- signatures
def annotation(value: Any) -> str:
    return value if isinstance(value, str) else inspect.formatannotation(value)


def default(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def signature(obj: Any) -> str:
    """``(a: int, *, b=1) -> str``, annotations as written (no quotes), defaults without addresses."""
    target = obj.fget if isinstance(obj, property) else obj
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return "(...)"
    parts: list[str] = []
    star = False
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls") and not inspect.isclass(obj):
        params = params[1:]  # a method, as called on an instance
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
        star = star or p.kind in (p.VAR_POSITIONAL, p.KEYWORD_ONLY)
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {annotation(p.annotation)}"
        if p.default is not p.empty:
            text += (" = " if p.annotation is not p.empty else "=") + default(p.default)
        parts.append(text)
        if p.kind is p.POSITIONAL_ONLY and p is params[-1]:
            parts.append("/")
    if isinstance(obj, property):
        parts = []
    returns = "" if sig.return_annotation is sig.empty or inspect.isclass(obj) else f" -> {annotation(sig.return_annotation)}"
    return f"({', '.join(parts)}){returns}"


# --------------------------------------------------------------------------- docstrings -> Markdown
def inline(text: str) -> str:
    """reStructuredText's inline markup as Markdown: roles, literals, links."""
    text = re.sub(r"`([^`<]+?)\s*<(https?://[^>]+)>`_", r"[\1](\2)", text)
    text = re.sub(r":\w+:`([^`<]+?)\s*<[^>]+>`", r"`\1`", text)
    text = re.sub(r":\w+:`~?([^`]+)`", lambda m: f"`{m.group(1).split('.')[-1] if m.group(0).count('~') else m.group(1)}`",
                  text)
    return text.replace("``", "`")


def block(lines: list[str], i: int) -> tuple[list[str], int]:
    """The indented block starting at line ``i`` (blank lines inside it kept), dedented; and the line after it."""
    taken = []
    while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
        taken.append(lines[i])
        i += 1
    while taken and not taken[-1].strip():
        taken.pop()
    while taken and not taken[0].strip():
        taken.pop(0)
    indent = min((len(s) - len(s.lstrip()) for s in taken if s.strip()), default=0)
    return [s[indent:] for s in taken], i


def items(lines: list[str]) -> list[str]:
    """An ``Args:``-style block as a Markdown list: one item per unindented line, continuation lines joined."""
    out: list[str] = []
    for line in lines:
        if line.strip() and not line.startswith(" "):
            m = ITEM.match(line)
            out.append(f"- `{m.group(1)}`{m.group(2) or ''}: {m.group(3)}" if m else f"- {line}")
        elif line.strip() and out:
            out[-1] += " " + line.strip()
    return [inline(s) for s in out]


def fenced(lines: list[str]) -> list[str]:
    # pycon, not python: tests/test_readme.py runs a page's ```python blocks, and these are doctests (run from
    # the docstrings by tests/test_api_reference.py)
    return ["```pycon" if any(s.startswith(">>>") for s in lines) else "```", *lines, "```"]


def markdown(doc: str) -> list[str]:
    """A docstring (already ``inspect.cleandoc``-ed) as Markdown lines (inline markup converted paragraph by
    paragraph, so a link broken over two lines stays one link)."""
    lines, out, para, i = doc.splitlines(), [], [], 0

    def flush() -> None:
        out.extend(inline("\n".join(para)).split("\n") if para else [])
        para.clear()

    while i < len(lines):
        line = lines[i]
        section = SECTION.match(line)
        if section:
            flush()
            name, code = section.group(1), section.group(2)
            body, i = block(lines, i + 1)
            out += ["", f"**{name}:**", ""]
            if code or name.startswith("Example"):
                out += fenced(body)
            elif name in LISTED:
                out += items(body)
            else:
                out.append(inline(" ".join(s.strip() for s in body)))
            out.append("")
        elif line.rstrip().endswith("::"):
            text = line.rstrip()[:-2].rstrip()
            para.append(text + ":" if text else "")
            flush()
            body, i = block(lines, i + 1)
            out += ["", *fenced(body), ""] if body else []
        elif line.startswith(">>>"):
            flush()
            start = i
            while i < len(lines) and lines[i].strip():
                i += 1
            out += ["", *fenced(lines[start:i]), ""]
        else:
            para.append(line)
            i += 1
    flush()
    return out


# --------------------------------------------------------------------------- the page
def docstring(obj: Any) -> str:
    """``obj``'s own docstring, cleaned (a class's, not one it inherits), or ""."""
    target = obj.fget if isinstance(obj, property) else obj
    own = vars(target).get("__doc__") if inspect.isclass(target) else target.__doc__
    return inspect.cleandoc(own) if own else ""


def entry(module: str, name: str, obj: Any, first: str, title: str) -> list[str]:
    """One name's part of the page: heading (``title``), signature, docstring (``first``: the name the object was
    documented under first; another name of it gets one line)."""
    if first != name:
        return [f"### {title}", "", f"`{module}.{name}` is `{module}.{first}` (the same object).", ""]
    method = "." in name
    kind = ("property" if isinstance(obj, property) else "method" if method else
            "class" if inspect.isclass(obj) else "function")
    doc = docstring(obj) or "(no docstring)"
    head = ["#### " if method else "### ", title]
    call = f"{module}.{name}" + ("" if kind == "property" else signature(obj))
    lines = ["".join(head), "", "```", f"{kind} {call}" if kind in ("class", "property") else call, "```", ""]
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        lines = lines[:3] + [f"class {module}.{name}", "```", ""]
        doc += "\n\nMembers: " + ", ".join(f"``{m.name}``" for m in obj)
    return lines + markdown(doc) + [""]


def render() -> str:
    """The whole page."""
    found = entries()
    first: dict[tuple[str, int], str] = {}
    for module, name, obj in found:
        first.setdefault((module, id(obj), name.rpartition(".")[0]), name)  # a class's own: an inherited method too
    out = ["# API reference", "",
           "The public API with its docstrings. Generated by `benchmarks/api_reference.py` from the docstrings: "
           "edit them, not this page. Guides: [concepts](concepts.md), [usage](usage.md), [codecs](codecs.md).", ""]
    titles = headings(found)
    current = None
    for module, name, obj in found:
        if module != current:
            current = module
            names = [n for m, n, _ in found if m == module and "." not in n]
            out += [f"## {module}", "", ", ".join(f"[`{n}`](#{anchor(titles[module, n])})" for n in names), ""]
        out += entry(module, name, obj, first[(module, id(obj), name.rpartition(".")[0])], titles[module, name])
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).rstrip("\n") + "\n"


def headings(found: list[tuple[str, str, Any]]) -> dict[tuple[str, str], str]:
    """Each entry's heading: its name, or where another heading of the page has its anchor (``Compressor`` of
    torchft, ``muon`` after ``Muon``) the module's last part and the name (``torchft.Compressor``)."""
    seen, out = {anchor("API reference")}, {}
    for module, name, _ in found:
        seen.add(anchor(module))
        text = name if anchor(name) not in seen else f"{module.rsplit('.', 1)[-1]}.{name}"
        out[module, name] = text
        seen.add(anchor(text))
    return out


def anchor(name: str) -> str:
    """GitHub's anchor of a heading ``name``."""
    return re.sub(r"[^\w\- ]", "", name.lower()).replace(" ", "-")


# --------------------------------------------------------------------------- the command line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/api_reference.py", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the page is not what this would write")
    p.add_argument("--output", default=OUTPUT, help="the page to write or check (default docs/api.md)")
    args = p.parse_args(argv)
    text = render()
    return write_or_check(text, args.output, OUTPUT, "api_reference.py", "entries", args.check)


if __name__ == "__main__":
    sys.exit(main())
