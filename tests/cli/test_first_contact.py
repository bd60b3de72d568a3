"""Starting like its peers: `--version`, a `--help` and argument errors that import no torch, a
light `import perfloop`, and `py.typed` shipped."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import perfloop


def imported_modules(code: str) -> set[str]:
    """The modules a fresh interpreter imports running `code` (from `python -X importtime`)."""
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, timeout=120
    )
    names = set()
    for line in p.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


def test_version_flags_print_the_installed_packages_version():
    for flag in ("--version", "-V"):
        p = subprocess.run(
            [sys.executable, "-m", "perfloop", flag], capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == f"perfloop {importlib.metadata.version('perfloop')}"
    assert perfloop.__version__ == importlib.metadata.version("perfloop")


def test_help_and_usage_errors_import_no_torch_scipy_or_ops():
    for argv in (["--help"], ["bench", "--help"], ["profile", "--help"], ["bneck"], ["history", "--last"]):
        code = (
            f"import sys; sys.argv = ['perfloop', *{argv!r}]\n"
            "from perfloop.cli import main\ntry: main()\nexcept SystemExit: pass"
        )
        mods = imported_modules(code)
        assert "perfloop.cli" in mods, argv  # the check saw the CLI load
        heavy = {m for m in mods if m.split(".")[0] in ("torch", "scipy", "numpy", "triton")}
        heavy |= {m for m in mods if m.startswith("perfloop.ops")}
        assert not heavy, (argv, sorted(heavy)[:5])


def test_import_perfloop_is_light_and_names_load_on_first_use():
    mods = imported_modules("import perfloop")
    assert "perfloop" in mods and not {m for m in mods if m.split(".")[0] in ("torch", "scipy")}
    code = (
        "import perfloop as pl, sys; pl.bench; print(*(m in sys.modules for m in ('torch', 'perfloop.ops')))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "False"]  # bench needs torch, not the op library
    assert callable(perfloop.bench) and perfloop.ops.get("gelu").name == "gelu"


def test_every_public_name_resolves_and_a_typo_says_so():
    for name in perfloop.__all__:
        assert getattr(perfloop, name) is not None
    try:
        perfloop.bnech  # noqa: B018
    except AttributeError as exc:
        assert "bnech" in str(exc)
    else:
        raise AssertionError("a misspelt name resolved")


def test_py_typed_ships_with_the_package():
    assert (Path(perfloop.__file__).parent / "py.typed").exists()
    text = Path(__file__).parents[2].joinpath("pyproject.toml").read_text()
    assert '"perfloop" = ["py.typed"]' in text
