"""Outputs that belong to one run of one command.

A command that writes a directory holds `DIR/.lock` while it runs (a second run into it fails at
once and names the holder), removes the temp files that killed writers left there, and records in
`DIR/.dflashkit-files.json` the entries it writes before it writes them. `--overwrite` removes
only entries so recorded: never a file of the user's, and never through a symbolic link. An
output that is handed on as it is (a tokenized file, an exported drafter) is locked from beside
it (`output_path`), and replaces only an earlier output of its command, never another file.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from dflashkit.checkpoint import atomic_write_json, remove_stale_temp_files, temp_path

LOCK = ".lock"
MANIFEST = ".dflashkit-files.json"


@dataclass
class OutputDir:
    """A locked output directory and the entries dflashkit wrote in it (its manifest)."""

    path: Path
    command: str
    written: set[str] = field(default_factory=set)

    def present(self, names: Iterable[str]) -> list[str]:
        """Those of `names` that are in the directory (a dangling link counts)."""
        return [n for n in names if (self.path / n).is_symlink() or (self.path / n).exists()]

    def record(self, names: Iterable[str]) -> None:
        """Note `names` as dflashkit's in the manifest, before they are written (a kill between the
        two leaves a name recorded that does not exist yet, never a written one unrecorded)."""
        new = set(names) - self.written
        if new:
            self.written |= new
            atomic_write_json(self.path / MANIFEST, {"command": self.command, "files": sorted(self.written)})

    def remove(self, names: Iterable[str], option: str = "--overwrite") -> None:
        """Remove the entries `names` that dflashkit wrote; refuse, before removing anything, if
        one of them is not in the manifest. A symbolic link is unlinked, what it points to kept."""
        names = self.present(names)
        foreign = [n for n in names if n not in self.written]
        if foreign:
            was, it = ("was", "it") if len(foreign) == 1 else ("were", "them")
            raise ValueError(f"{self.path}: {', '.join(foreign)} {was} not written by dflashkit ({MANIFEST} does not "
                             f"list {it}), so {option} leaves {it} alone: move {it} away or choose another output "
                             "directory")
        for n in names:
            remove_entry(self.path / n)


def remove_entry(p: Path) -> None:
    """Delete a file or a directory tree; a link itself, never what it points to (rmtree does not
    follow links inside the tree either)."""
    if p.is_symlink() or not p.is_dir():
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p)


def make_dir(path: Path) -> None:
    """`mkdir -p path`, or one line when a file stands where a folder must be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"{path}: expected a directory (or none yet), but it or a folder above it is a file") from None


def _read_manifest(path: Path) -> set[str]:
    file = path / MANIFEST
    if file.is_symlink() or not file.is_file():
        return set()
    try:
        files = json.loads(file.read_text(encoding="utf-8")).get("files")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        files = None
    if not isinstance(files, list) or not all(isinstance(n, str) and n and "/" not in n and n not in (".", "..")
                                              for n in files):
        raise ValueError(f"{file}: expected {{\"files\": [names of entries in {path}]}}; it lists what dflashkit "
                         "wrote there (remove the file if the directory holds nothing of dflashkit's)")
    return set(files)


@contextmanager
def hold_lock(lock_path: Path, command: str, what: str) -> Iterator[None]:
    """Hold `lock_path` (flock) while the block runs; the file says who holds it, for the message
    a second run gets at once. A run refused for its input (a ValueError: a directory holding an
    earlier run, features of other settings) puts back what the file said before: it did nothing
    there, and the file goes on naming the run it was refused by. A link in the lock's place is
    refused, never written through."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise ValueError(f"{lock_path}: a symbolic link where dflashkit's lock file goes; remove it (a lock is "
                         "never written through a link)") from None
    with open(fd, "r+", encoding="utf-8") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock.read().strip() or "another run"
            raise RuntimeError(f"{what} is in use by {holder} (it holds {lock_path}); wait for it to finish or "
                               "write elsewhere") from None
        before = lock.read()
        _name_holder(lock, f"`dflashkit {command}` (pid {os.getpid()})\n")
        try:
            yield
        except ValueError:
            _name_holder(lock, before)
            raise


def _name_holder(lock: TextIO, text: str) -> None:
    lock.seek(0)
    lock.truncate()
    lock.write(text)
    lock.flush()


@contextmanager
def output_directory(path: str | Path, command: str, *, temp_dirs: Sequence[str] = (),
                     lock: str = LOCK) -> Iterator[OutputDir]:
    """Lock the output directory `path` (created if missing) for a run of `command`, remove the
    temp files that killed writers left in it and in its subdirectories `temp_dirs`, and give its
    manifest. `lock`: another lock file name, for processes of one job that share the directory
    (ranks), each holding its own."""
    path = Path(path)
    if path.is_symlink() and not path.is_dir():
        raise ValueError(f"{path}: a symbolic link to nothing; expected an output directory")
    make_dir(path)
    with hold_lock(path / lock, command, str(path)):
        for d in (path, *(path / t for t in temp_dirs)):
            if d.is_dir() and not d.is_symlink():
                remove_stale_temp_files(d)
        yield OutputDir(path, command, _read_manifest(path))


@contextmanager
def output_path(path: str | Path, command: str, ours: Callable[[Path], bool], kind: str) -> Iterator[Path]:
    """Lock the output `path`, a file or a directory that is handed on as it is (an exported
    drafter), with `.NAME.lock` beside it, not in it; remove the temp files that killed writers
    left of it (and in it, for a directory). What stands at `path` is replaced only where
    `ours(path)` finds an earlier output of the command (`kind` says what that is): anything else
    is refused and left as it is."""
    path = Path(path)
    make_dir(path.parent)
    with hold_lock(path.with_name(f".{path.name}.lock"), command, str(path)):
        if (path.is_symlink() or path.exists()) and not ours(path):
            raise ValueError(f"{path}: not {kind}, and `dflashkit {command}` replaces only its own earlier output, "
                             "so it leaves this alone: move it away or choose another output")
        remove_stale_temp_files(path.parent, path.name)
        if path.is_dir() and not path.is_symlink():
            remove_stale_temp_files(path)
        yield path


def replace_dir(final: Path, write: Callable[[Path], Any]) -> None:
    """Write a directory under a temporary name (`checkpoint.temp_path`'s, so that a later run
    removes it if this one is killed), then rename it into place."""
    tmp = temp_path(final)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists() and not final.is_symlink():
        old = temp_path(final.with_name(f"{final.name}.old"))
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        final.unlink(missing_ok=True)  # a link in its place: replaced, what it points to kept
        os.replace(tmp, final)
