"""Dump every command-line option of `vllm serve` (vLLM 0.33.0) to a JSON fixture.

Tests validate rendered vLLM command lines against this fixture, so they never need to import
vLLM. This script is the only place that does: it builds the real `vllm serve` parser (the same
code path as the `vllm` CLI: `ServeSubcommand.subparser_init`, which calls `make_arg_parser` from
`vllm.entrypoints.common.cli_args` on a `FlexibleArgumentParser`), walks `parser._actions` (which
holds the actions of every argument group too), and writes one JSON record per option:

    flags            the option strings shown in help, e.g. ["--tensor-parallel-size", "-tp"]
    hidden_flags     option strings the parser also accepts but hides from help
                     (e.g. "--no-enable-prefix-caching")
    dest             the attribute name on the parsed namespace
    takes_value      False for actions that consume no argument (store_true/store_false/count,
                     help, and BooleanOptionalAction with its --no-/--disable- forms)
    nargs            argparse's nargs (null, "?", "*", "+", or an int)
    choices          the allowed values, or null
    type             the __name__ of the type callable, or null
    wrapped_type     for vLLM's `optional_type(T)`/`parse_type(T)` wrappers, the __name__ of the
                     innermost T (e.g. "int"); otherwise null
    boolean_optional True for BooleanOptionalAction (vLLM's EnableDisableAction)

Positional arguments (just `model_tag`) are listed separately under "positionals". Options are
sorted by their first flag so the output is deterministic.

What the fixture does not capture: `FlexibleArgumentParser.parse_args` also rewrites argv before
argparse sees it. It accepts underscores for dashes in long flags (`--max_model_len`), dotted JSON
keys (`--kv-transfer-config.kv_role kv_producer`, `--x.key+ value`), `-O3` for
`--optimization-level 3`, moves `--model X` to the positional, and reads `--config FILE`.

How to run (inside an environment where vLLM 0.33.0 is installed; no GPU needed):

    VLLM_TARGET_DEVICE=cpu python scripts/extract_vllm_args.py [--out PATH]

Without a GPU, building the parser fails with "Failed to infer device type" unless
VLLM_TARGET_DEVICE=cpu is set; the script sets it when it is unset. --out defaults to
tests/fixtures/vllm/vllm-0.33.0-serve-args.json under the repository root.

A light CPU-only environment is enough (about 2.5 GB, a few minutes): a virtual environment with
a CPU build of torch, `pip install --no-deps vllm==0.33.0`, vLLM's pure-Python dependencies from
its wheel metadata, and xgrammar, apache-tvm-ffi, llguidance, outlines_core, lm-format-enforcer,
compressed-tensors and depyf installed with `--no-deps` (so none of them pulls CUDA torch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.33.0"
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "vllm" / f"vllm-{VLLM_VERSION}-serve-args.json"


def build_serve_parser() -> argparse.ArgumentParser:
    """Build the `vllm serve` parser exactly as the `vllm` CLI does."""
    # Must be set before vLLM is imported: the platform is chosen at import time.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

    import vllm
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if vllm.__version__ != VLLM_VERSION:
        sys.exit(f"expected vLLM {VLLM_VERSION}, but vLLM {vllm.__version__} is installed")

    root = FlexibleArgumentParser(prog="vllm")
    subparsers = root.add_subparsers(dest="subparser")
    return ServeSubcommand().subparser_init(subparsers)


def type_name(func: Any) -> str | None:
    """Return the name of an argparse `type` callable (a class, function or lambda)."""
    if func is None:
        return None
    return str(getattr(func, "__name__", type(func).__name__))


def wrapped_type(func: Any) -> Any:
    """Return T when `func` is vLLM's `optional_type(T)` or `parse_type(T)` wrapper, else None.

    Both wrappers (in vllm/engine/arg_utils.py) are closures over a variable named `return_type`.
    """
    code = getattr(func, "__code__", None)
    closure = getattr(func, "__closure__", None)
    if code is None or closure is None or "return_type" not in code.co_freevars:
        return None
    return closure[code.co_freevars.index("return_type")].cell_contents


def wrapped_type_name(func: Any) -> str | None:
    """Return the name of the innermost type inside nested vLLM type wrappers, or None."""
    inner = wrapped_type(func)
    if inner is None:
        return None
    while wrapped_type(inner) is not None:
        inner = wrapped_type(inner)
    return type_name(inner)


def json_value(value: Any) -> Any:
    """Make a `choices` entry JSON-friendly (enum members and other objects become strings)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def describe(action: argparse.Action, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Describe one argparse action as a JSON-ready dict."""
    hidden = sorted(
        flag
        for flag, registered in parser._option_string_actions.items()
        if registered is action and flag not in action.option_strings
    )
    return {
        "flags": list(action.option_strings),
        "hidden_flags": hidden,
        "dest": action.dest,
        "takes_value": action.nargs != 0,
        "nargs": action.nargs,
        "choices": None if action.choices is None else [json_value(c) for c in action.choices],
        "type": type_name(action.type),
        "wrapped_type": wrapped_type_name(action.type),
        "boolean_optional": isinstance(action, argparse.BooleanOptionalAction),
    }


def extract(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Return the fixture document for `parser`."""
    options: list[dict[str, Any]] = []
    positionals: list[dict[str, Any]] = []
    # parser._actions holds every action, including those added to argument groups.
    for action in parser._actions:
        if action.option_strings:
            options.append(describe(action, parser))
        else:
            positionals.append(describe(action, parser))
    options.sort(key=lambda option: option["flags"][0])
    return {
        "vllm_version": VLLM_VERSION,
        "generated_by": "scripts/extract_vllm_args.py",
        "options": options,
        "positionals": positionals,
    }


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"where to write the JSON (default: {DEFAULT_OUT.relative_to(ROOT)})",
    )
    out: Path = cli.parse_args().out

    document = extract(build_serve_parser())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {len(document['options'])} options to {out}")


if __name__ == "__main__":
    main()
