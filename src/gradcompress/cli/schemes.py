"""Which schemes each command runs: the one check every scheme passes before any worker starts.

The grammar is :mod:`gradcompress.scheme`'s and what a scheme becomes is :func:`gradcompress.factory.build`'s; this
module says which schemes a command takes, with the messages the commands print (one line, :class:`CLIError`).
:func:`check` is the checker of every command:

* ``command="train"``: ``demo`` and ``train`` (codec specs with Compressor and scheme options, ``onebitadam``,
  ``decoupled``; not PyTorch's baselines), with train's ``--fsdp`` and ``--diloco``; every option's value is checked
  by building the Compressor (DeMo for ``decoupled``) once, and the scheme comes back with every option spelled out;
* ``command="netbench"``: ``netbench`` and ``plan`` (codec specs, ``codec:diloco=H``, PyTorch's ``ddp``,
  ``torch-fp16`` and ``torch-powersgd``, netbench's ``ddp-nosend``, DeMo's ``decoupled`` and, with ``--fsdp``,
  ``fsdp``; not ``onebitadam`` nor ``compressed_adam=true``), with ``--fsdp`` and ``--nodes`` (then the schemes of
  :mod:`gradcompress.testbed.netbench_fsdp`); the scheme comes back as given. :func:`check_schemes` checks a list.

Under ``--fsdp`` every codec must be one FSDP's reduce-scatter can carry
(:func:`gradcompress.adapters.fsdp.check_codec`: not PowerSGD).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..scheme import AUTO, BASELINES, DECOUPLED, ONEBITADAM, Scheme, parse_scheme, scheme_name
from .common import CLIError, one_line

if TYPE_CHECKING:
    from ..codecs import Codec

TRAIN, NETBENCH = "train", "netbench"
COMMANDS = (TRAIN, NETBENCH)


def check(text: str, command: str = TRAIN, *, fsdp: bool = False, diloco: bool = False, nodes: bool = False) -> str:
    """The scheme as ``command`` names it (see the module docstring), or ``CLIError`` (one line) for a scheme the
    command cannot run with these flags (``diloco``: train's ``--diloco H``; ``nodes``: netbench's ``--nodes``)."""
    if command not in COMMANDS:
        raise ValueError(f"command must be one of {', '.join(COMMANDS)}, got {command!r}")
    if command == NETBENCH:
        named = _netbench_name(text, fsdp, nodes)
        if named is not None:
            return named
    scheme = parse_cli_scheme(text, command)
    canonical = _validated(scheme) if command == TRAIN else scheme.text
    why = _refusal(scheme, command, fsdp, diloco)
    if why:
        raise CLIError(one_line(why))
    if fsdp and scheme.kind != AUTO:
        from ..adapters.fsdp import check_codec

        try:
            check_codec(scheme.codec)
        except ValueError as err:
            raise CLIError(one_line(err)) from None
    return canonical


def check_schemes(texts: list[str], fsdp: bool = False, nodes: bool = False) -> list[str]:
    """netbench's (and plan's) schemes, each checked (:func:`check`), as the run names them."""
    return [check(t, NETBENCH, fsdp=fsdp, nodes=nodes) for t in texts]


def parse_cli_scheme(text: str, command: str = TRAIN) -> Scheme:
    """``text`` parsed (:func:`gradcompress.scheme.parse_scheme`); ``CLIError`` (one line) if it is wrong, listing
    the command's schemes for an unknown one (and for PyTorch's baselines or an empty one under train)."""
    if command == TRAIN and (not isinstance(text, str) or not text.strip()):
        raise CLIError(f"empty scheme; valid schemes: {valid_schemes()}")
    if command == TRAIN and scheme_name(text) in BASELINES:  # PyTorch's own DDP schemes: netbench and plan only
        raise CLIError(_unknown(text, command))
    try:
        return parse_scheme(text)
    except (ValueError, TypeError) as err:
        msg = one_line(err)
        raise CLIError(_unknown(text, command) if "unknown codec" in msg else msg) from None


def valid_schemes() -> str:
    """The scheme names demo and train take, for error messages."""
    import gradcompress

    return ", ".join([AUTO] + gradcompress.available() + [ONEBITADAM, DECOUPLED])


def _unknown(text: str, command: str) -> str:
    import gradcompress

    name = scheme_name(text)
    if command == TRAIN:
        return f"unknown scheme {name!r}; valid schemes: {valid_schemes()}"
    return (f"unknown scheme {name!r}; valid: ddp, torch-fp16, torch-powersgd, {AUTO}, "
            f"{', '.join(gradcompress.available())}, {DECOUPLED}")


def _netbench_name(text: str, fsdp: bool, nodes: bool) -> str | None:
    """netbench's own scheme names and, with ``--fsdp --nodes``, the FSDP-on-nodes schemes; None for the others."""
    from ..testbed.netbench import FSDP_BASELINE, NOSEND

    if fsdp and nodes:
        return _fsdp_node_scheme(text)
    if fsdp and text.strip() == FSDP_BASELINE:
        return FSDP_BASELINE
    if text.strip() == NOSEND:
        if fsdp:
            raise CLIError(f"{NOSEND} is a DDP scheme; it does not combine with --fsdp")
        return NOSEND
    return None


def _fsdp_node_scheme(text: str) -> str:
    """A scheme of netbench --fsdp --nodes (:mod:`gradcompress.testbed.netbench_fsdp`): a baseline, or a codec FSDP
    can carry with ``layout=`` and ``params=``."""
    from ..adapters.fsdp import check_codec
    from ..spec import make
    from ..testbed.netbench_fsdp import split_fsdp_scheme

    try:
        codec, _, _ = split_fsdp_scheme(text)
        if codec is not None:
            check_codec(make(codec))
    except (ValueError, TypeError) as err:
        raise CLIError(f"--fsdp: {err}") from None
    return text.strip()


def _refusal(scheme: Scheme, command: str, fsdp: bool, diloco: bool) -> str | None:
    """Why ``command`` cannot run ``scheme`` with these flags; None when it can."""
    adam = scheme.kind == ONEBITADAM or scheme.compressed_adam
    if command == NETBENCH:
        if scheme.kind == ONEBITADAM:
            return _unknown(scheme.text, command)
        if scheme.kind == DECOUPLED and fsdp:
            return "--fsdp does not apply to decoupled (DeMo averages each worker's unsharded momentum itself)"
        if scheme.compressed_adam:
            return (f"{scheme.text}: compressed_adam=true trains with CompressedAdam, which netbench does not run; "
                    "netbench runs DDP schemes, codec specs and codec:diloco=H")
        if scheme.diloco and fsdp:
            return "DiLoCo schemes do not combine with --fsdp"
        if fsdp and scheme.kind not in ("ours", AUTO):
            return (f"--fsdp: {scheme.text!r} is a DDP scheme; in FSDP mode the baseline is 'fsdp' and the others "
                    "are gradcompress codec specs")
        return None
    if scheme.kind == AUTO and diloco:
        return "--diloco takes a codec for the outer gradient; auto chooses the codec of each step's buckets"
    if scheme.kind == DECOUPLED and (fsdp or diloco):
        return ("--fsdp and --diloco do not apply to decoupled (DeMo averages each worker's unsharded momentum "
                "components itself, every step)")
    if fsdp and adam:
        return ("--fsdp does not apply to onebitadam or compressed_adam=true (they average unsharded momenta "
                "themselves)")
    if diloco and (fsdp or adam):
        return ("--diloco takes a codec for the outer gradient; it does not combine with --fsdp, onebitadam or "
                "compressed_adam=true")
    return None


def _validated(scheme: Scheme) -> str:
    """demo's and train's form of a scheme, every option's value checked by building what runs it once: the
    Compressor (its options too), DeMo for ``decoupled``; ``onebitadam``'s options are numbers (the grammar checked)."""
    import gradcompress

    try:
        if scheme.kind == DECOUPLED:
            import torch

            from ..optim import DeMo

            DeMo([torch.zeros(1, requires_grad=True)], **scheme.demo)  # checks every option's value
        elif scheme.kind == AUTO:
            gradcompress.Compressor(scheme.text)
        elif scheme.kind != ONEBITADAM:
            gradcompress.Compressor(scheme.codec, **scheme.compressor)  # checks the Compressor's options too
    except (ValueError, TypeError) as err:
        raise CLIError(one_line(err)) from None
    return scheme.canonical()


def is_adam_scheme(scheme: str) -> bool:
    """True for ``onebitadam`` and for ``<codec spec>,compressed_adam=true`` (the optimizer exchanges itself)."""
    try:
        parsed = parse_cli_scheme(scheme)
    except CLIError:
        return False
    return parsed.kind == ONEBITADAM or parsed.compressed_adam


def split_scheme(scheme: str) -> tuple[Codec, dict[str, Any]]:
    """``"sign:bucket=256,momentum=0.9"`` -> (the sign codec with bucket 256, ``{"momentum": 0.9}``).

    Options the codec has go to the codec (``dgc:momentum=...`` is DGC's own); the others,
    if they are Compressor options a scheme may set, to the Compressor (:func:`gradcompress.scheme.parse_scheme`).
    ``ValueError`` otherwise.
    """
    parsed = parse_scheme(scheme)
    if parsed.kind != "ours":
        raise ValueError(f"{scheme_name(scheme)!r} is not a codec spec")
    return parsed.codec, parsed.compressor


def onebitadam_problem() -> str | None:
    """None when ``gradcompress.optim.OneBitAdam`` can be imported, else why not (one line)."""
    try:
        from ..optim import OneBitAdam  # noqa: F401 - imported only to see that it imports
    except Exception as err:  # ImportError, or a half-written module
        return f"gradcompress.optim.OneBitAdam is not available ({type(err).__name__}: {one_line(err)})"
    return None


__all__ = ["COMMANDS", "NETBENCH", "TRAIN", "check", "check_schemes", "is_adam_scheme", "onebitadam_problem",
           "parse_cli_scheme", "split_scheme", "valid_schemes"]
