"""The output directory of an example script: made by the script, never someone else's data.

An example writes into ``--out DIR``. :func:`prepare_output` creates ``DIR`` (or takes it if it
is empty) and leaves a marker file in it that names the script. A later run of the same script
empties a directory that carries its marker and reuses it. Any other non-empty directory is
refused, and nothing in it is touched, unless the user passes ``--force``: pointing an example at
a home directory or a project by mistake deletes nothing.
"""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

__all__ = ["MARKER", "OutputDirError", "prepare_output"]

#: The file an example leaves in a directory it created.
MARKER = ".shardkeep-example-output"


class OutputDirError(Exception):
    """The output directory cannot be used; nothing was deleted."""


def _made_by(directory: Path) -> str | None:
    """The script named by ``directory``'s marker, or ``None`` (no marker, or not a plain file)."""
    marker = directory / MARKER
    try:
        if not stat.S_ISREG(marker.lstat().st_mode):
            return None
        first = marker.read_text(encoding="utf-8", errors="replace").partition("\n")[0]
    except OSError:
        return None
    prefix = "made by "
    return first[len(prefix) :].strip() if first.startswith(prefix) else None


def _holds_something_precious(directory: Path) -> str | None:
    """Why ``--force`` must not empty ``directory`` even so (the root, home, or the current
    directory or one of its parents), or ``None``."""
    resolved = directory.resolve()
    if resolved == Path(resolved.anchor):
        return "it is the filesystem root"
    if resolved == Path.home().resolve():
        return "it is your home directory"
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        return "it holds the current directory"
    return None


def _empty(directory: Path) -> None:
    """Remove everything inside ``directory`` (never following symlinks), keeping it."""
    for child in directory.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def prepare_output(directory: Path, script: str, *, force: bool = False) -> Path:
    """Make ``directory`` an empty directory marked as ``script``'s output, and return it.

    - missing or empty: created, marked;
    - marked by ``script`` (an earlier run): emptied and reused;
    - anything else that is not empty: :class:`OutputDirError`, unless ``force``, which empties
      it (never the filesystem root, the home directory, or the current directory or a parent).

    A symlink or a file at ``directory`` is refused whatever ``force`` says.
    """
    if directory.is_symlink():
        raise OutputDirError(
            f"{directory} is a symlink; nothing was deleted. Give the directory it points to, or a new path"
        )
    if directory.exists() and not directory.is_dir():
        raise OutputDirError(f"{directory} exists and is not a directory; nothing was deleted. Give a new path")
    if directory.is_dir():
        entries = sorted(child.name for child in directory.iterdir())
        if entries:
            owner = _made_by(directory)
            if owner == script:
                _empty(directory)
            elif force:
                reason = _holds_something_precious(directory)
                if reason is not None:
                    raise OutputDirError(
                        f"refusing to empty {directory} even with --force: {reason}; nothing was deleted"
                    )
                print(f"--force: deleting everything in {directory} ({len(entries)} entries)", flush=True)
                _empty(directory)
            else:
                shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
                whose = f"made by {owner}" if owner else f"not made by {script}"
                raise OutputDirError(
                    f"{directory} is not empty ({len(entries)} entries: {shown}) and was {whose}; nothing was "
                    "deleted. Give a new or empty directory, or pass --force to delete everything in it"
                )
    else:
        directory.mkdir(parents=True)
    (directory / MARKER).write_text(
        f"made by {script}\nA later run of {script} empties this directory and writes into it again.\n",
        encoding="utf-8",
    )
    return directory
