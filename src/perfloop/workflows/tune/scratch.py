"""What the script writes during tune's runs is put back after each: the user's files stay as
they were.

Copy-on-write, in two halves. In the child, before the script starts, `keep` wraps what Python
writes a file through -- open/io.open and os.open for writing, os.replace/rename, os.remove/unlink,
os.truncate, os.mkdir, torch.save (whose path is written by C++, past open) -- so that the first
time a path under the script's folder or the working directory is about to change, its bytes are
copied aside (or it is noted as not there yet), one line of a manifest each, before the change.
In the parent, after the run's processes have all ended, `restore` copies each back (its bytes
and its times) and removes what did not exist; `snapshot` before and after then finds what
changed past the hooks (C code of its own, a subprocess) for tune to say. A script that writes
nothing costs a mode check per open.

    >>> before, capped = snapshot(["."], skip=[])
    >>> changed(before, snapshot(["."], skip=[])[0])
    []
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import os
import shutil
import stat

LIMIT = 20_000  # files a snapshot looks at: a data folder under the script's is not walked whole
SKIP = {
    ".git",
    ".hg",
    ".svn",
    "__pycache__",
    ".venv",
    "venv",
    "site-packages",
    "node_modules",
    ".cache",
    ".triton",
}
SKIP_PREFIXES = (".mypy_cache", ".pytest_cache", ".ruff_cache", ".tox", "torchinductor_")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _skipped(name: str) -> bool:
    return name in SKIP or name.startswith(SKIP_PREFIXES)


def _under(path: str, folders: list[str]) -> bool:
    return any(path == f.rstrip(os.sep) or path.startswith(f) for f in folders)


def _folders(paths) -> list[str]:
    return sorted({os.path.join(os.path.realpath(p), "") for p in paths})


def checked(roots: list[str]) -> list[str]:
    """The roots whose files a snapshot compares: not a folder other programs write in too (the
    temp folder, the home folder, /), where a change is nobody's in particular; the script's own
    writes there are still kept and put back through the hooks."""
    import tempfile

    shared = _folders([tempfile.gettempdir(), os.path.expanduser("~"), os.sep])
    return [r for r in _folders(roots) if r not in shared]


def snapshot(roots: list[str], skip: list[str]) -> tuple[dict[str, tuple[int, int]], bool]:
    """(path -> (size, mtime_ns) of each file under roots, bar `skip` folders and SKIP's, and
    whether LIMIT cut the walk short)."""
    skipped, files = _folders(skip), {}
    for root in _folders(roots):
        for top, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if not _skipped(d) and not _under(os.path.join(top, d), skipped)]
            for name in names:
                path = os.path.join(top, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                files[path] = (st.st_size, st.st_mtime_ns)
                if len(files) >= LIMIT:
                    return files, True
    return files, False


def changed(before: dict, after: dict) -> list[str]:
    """Each file changed, made or gone between two snapshots, in words."""
    out = [f"{p} (changed)" for p in sorted(before) if p in after and after[p] != before[p]]
    out += [f"{p} (made)" for p in sorted(set(after) - set(before))]
    out += [f"{p} (gone)" for p in sorted(set(before) - set(after))]
    return out


class _Keeper:
    def __init__(self, roots: list[str], skip: list[str], backup: str, manifest: str):
        self.roots, self.skip, self.backup = _folders(roots), _folders(skip), backup
        self.seen: set[str] = set()
        self.open = io.open
        self.manifest = self.open(manifest, "a", buffering=1)  # a line each, in the order kept

    def kept(self, path, kind: str = "") -> None:
        """Before `path` changes: its bytes copied aside, or noted as not there (`kind` "dir": a
        folder just made), the first time only."""
        if not isinstance(path, (str, bytes, os.PathLike)):
            return  # a file descriptor (its file was kept when opened), or what the call refuses
        p = os.path.realpath(os.fsdecode(path))
        if (p in self.seen and not kind) or not _under(p, self.roots) or _under(p, self.skip):
            return
        if any(_skipped(part) for part in p.split(os.sep)):
            return
        self.seen.add(p)
        entry = {"path": p, "kind": kind or "absent"}
        if not kind and os.path.isfile(p):
            entry.update(kind="file", copy=os.path.join(self.backup, f"{os.getpid()}-{len(self.seen)}"))
            try:
                with self.open(p, "rb") as src, self.open(entry["copy"], "wb") as dst:
                    shutil.copyfileobj(src, dst)
                shutil.copystat(p, entry["copy"])
            except OSError:
                return  # not readable, or no room: the script writes on, the snapshot says it
        elif not kind and os.path.lexists(p):
            return  # a folder or a special file: not copied
        self.manifest.write(json.dumps(entry) + "\n")


def keep(roots: list[str], skip: list[str], backup: str, manifest: str) -> None:
    """Wrap what Python writes files through (see the module's doc) in this process and those
    it forks; `skip`: folders under roots left alone (tune's own logs)."""
    k = _Keeper(roots, skip, backup, manifest)

    def opened(file, mode="r", *args, **kwargs):
        if isinstance(mode, str) and any(c in mode for c in "wax+"):
            k.kept(file)
        return k.open(file, mode, *args, **kwargs)

    builtins.open = io.open = opened
    _wrap(
        os,
        "open",
        lambda path, flags, *a, **kw: flags & _WRITE_FLAGS and not kw.get("dir_fd") and k.kept(path),
    )
    for name in ("replace", "rename"):
        _wrap(os, name, lambda src, dst, *a, **kw: kw or (k.kept(src), k.kept(dst)))
    for name in ("remove", "unlink", "truncate"):
        _wrap(os, name, lambda path, *a, **kw: kw.get("dir_fd") or k.kept(path))
    mkdir = os.mkdir

    def made(path, *args, **kwargs):
        mkdir(path, *args, **kwargs)
        if not kwargs.get("dir_fd"):
            k.kept(path, kind="dir")

    os.mkdir = made
    import torch

    _wrap(torch, "save", lambda obj, f, *a, **kw: isinstance(f, (str, bytes, os.PathLike)) and k.kept(f))


def _wrap(module, name: str, before) -> None:
    """module.name with `before(*args, **kwargs)` called first."""
    fn = getattr(module, name)

    def wrapped(*args, **kwargs):
        before(*args, **kwargs)
        return fn(*args, **kwargs)

    setattr(module, name, wrapped)


def restore(manifest: str) -> None:
    """Put back what the manifest kept: each file's bytes and times, files that were not there
    removed, folders made removed where empty. The first line of a path is its original."""
    try:
        with open(manifest) as f:
            entries = [json.loads(line) for line in f if line.endswith("\n")]
    except OSError:
        return  # nothing was written
    first: dict[tuple[str, bool], dict] = {}
    for e in entries:
        first.setdefault((e["path"], e["kind"] == "dir"), e)
    folders = []
    for e in first.values():
        path = e["path"]
        if e["kind"] == "dir":
            folders.append(path)
        elif e["kind"] == "file" and not os.path.isdir(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            shutil.copyfile(e["copy"], path)
            shutil.copystat(e["copy"], path)
        elif e["kind"] == "absent" and os.path.lexists(path) and not stat.S_ISDIR(os.lstat(path).st_mode):
            os.remove(path)
    for path in sorted(folders, reverse=True):  # the deepest first
        with contextlib.suppress(OSError):  # one holding what was not kept: the snapshot says it
            os.rmdir(path)
