"""The public surface DESIGN.md names is typed (py.typed ships): every function and method of
`perfloop`'s names, the op contract and perfloop.nn has annotated parameters and return."""

import inspect

import perfloop as pl
import perfloop.nn as pnn
from perfloop import ops
from perfloop.ops.base import Op, Variant


def _untyped(obj) -> bool:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return False
    named = [
        p
        for p in sig.parameters.values()
        if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    return sig.return_annotation is inspect.Signature.empty or any(p.annotation is p.empty for p in named)


def _public():
    objs = [(n, getattr(pl, n)) for n in pl.__all__ if n not in ("__version__", "ops")]
    objs += [("ops.get", ops.get), ("ops.names", ops.names), ("Op", Op), ("Variant", Variant)]
    objs += [(f"nn.{n}", getattr(pnn, n)) for n in pnn.__all__]
    for name, obj in objs:
        if not inspect.isclass(obj):
            yield name, obj
            continue
        for attr, member in vars(obj).items():
            if attr.startswith("_") and attr != "__init__":
                continue
            member = member.fget if isinstance(member, property) else member
            member = getattr(member, "__func__", member)
            if inspect.isfunction(member):
                yield f"{name}.{attr}", member


def test_every_public_function_and_method_is_annotated():
    found = list(_public())
    assert len(found) > 60  # the check saw the surface
    missing = [name for name, obj in found if _untyped(obj)]
    assert missing == [], missing


def test_a_bad_argument_is_a_typed_error_naming_it_that_the_cli_says_as_its_flag():
    """The layers below the CLI raise errors.ArgumentError (a ValueError) naming the argument;
    the CLI says it as the flag the user typed, by the error's field, not its text."""
    import pytest

    from perfloop import ops
    from perfloop.cli.args import UsageError, shape_errors
    from perfloop.errors import ArgumentError

    with pytest.raises(ArgumentError) as got:
        ops.get("gelu").check_shape((0, 4))
    assert got.value.argument == "shape" and isinstance(got.value, ValueError)
    want = r"^--shapes: \(0, 4\): sizes must be positive integers$"
    with pytest.raises(UsageError, match=want), shape_errors("--shapes"):
        ops.get("gelu").check_shape((0, 4))
    with pytest.raises(ValueError, match="shape: not mine"), shape_errors():  # a plain ValueError passes on
        raise ValueError("shape: not mine")
