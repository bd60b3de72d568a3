"""`perfloop completion bash|zsh|tcsh`: the shell's completion script for every verb and flag
(made by shtab from the parser itself, so it cannot fall behind it).

    perfloop completion bash > ~/.local/share/bash-completion/completions/perfloop
    perfloop completion zsh > "${fpath[1]}/_perfloop"
"""

from __future__ import annotations

from perfloop.cli.args import UsageError

SHELLS = ("bash", "zsh", "tcsh")


def register(verb) -> None:
    p = verb("completion", "print the shell completion script (bash, zsh, tcsh) for perfloop", run, js=False)
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")


def run(args) -> int:
    try:
        import shtab
    except ModuleNotFoundError:
        raise UsageError("completion: needs shtab (pip install shtab)") from None
    from perfloop.cli import build_parser

    print(shtab.complete(build_parser(), shell=args.shell))
    return 0
