"""vLLM flags that the router must know too: which tool-call and reasoning parsers the prefill runs.

Contract:
- ``parser_flags(vllm_args)`` reads vLLM's ``--tool-call-parser``, ``--reasoning-parser``,
  ``--tool-strict-level`` and ``--enable-auto-tool-choice`` (``--flag value`` or ``--flag=value``) from the arguments an
  operator passes to vLLM, and returns them as the router's flags: the router and the prefill are
  configured from the same words, so they cannot disagree.
- ``check_vllm_args(vllm_args)`` raises ValueError with the valid names when a parser name is not
  in vLLM's registries (``expresslane up`` and ``expresslane prefill`` stop at start with it),
  or when ``--enable-auto-tool-choice`` comes without ``--tool-call-parser``.
"""

from __future__ import annotations

PARSER_FLAGS = ("--tool-call-parser", "--reasoning-parser", "--tool-strict-level")
AUTO_TOOLS = "--enable-auto-tool-choice"


def value(args: list[str], flag: str) -> str:
    """The last value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``), "" when absent."""
    found = ""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found


def parser_flags(vllm_args: list[str]) -> list[str]:
    """The router flags that match the prefill vLLM's parser flags."""
    out: list[str] = []
    for flag in PARSER_FLAGS:
        name = value(vllm_args, flag)
        if name:
            out += [flag, name]
    if AUTO_TOOLS in vllm_args:
        out.append(AUTO_TOOLS)
    return out


def check_vllm_args(vllm_args: list[str]) -> None:
    """ValueError (what to do) for a parser name vLLM does not know."""
    tool, reasoning = value(vllm_args, "--tool-call-parser"), value(vllm_args, "--reasoning-parser")
    if AUTO_TOOLS in vllm_args and not tool:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (as in vLLM)")
    from services.router.vllm_surface import check_parsers

    check_parsers(tool or None, reasoning or None)


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``[own args] -- [vLLM args]`` -> (own, vLLM)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return list(argv), []
