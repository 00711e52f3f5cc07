"""Model files are regular files: a FIFO, a device or a socket is refused by `stat`,
before anything opens it. Opening a FIFO for reading blocks until a writer comes (a load
that never ends, and a thread that holds up shutdown); a device can be endless."""
from __future__ import annotations

import os
import stat
from pathlib import Path

# what a Hugging Face model folder's loader reads (the tokenizer, the config, the weights)
FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja")


class NotRegularFile(ValueError):
    """A path a loader would open is not a regular file (an HTTP 400 naming it)."""


def kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a folder" if stat.S_ISDIR(mode) else "not a regular file"


def require_regular(path: str | Path) -> os.stat_result:
    """The file's stat (links followed); NotRegularFile unless it is a regular file.
    A missing file raises FileNotFoundError as `os.stat` does."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(f"{path} is {kind(st.st_mode)}, not a regular file: "
                             "a model is read from regular files only")
    return st


def is_regular(path: str | Path) -> bool:
    """For scans of a folder: non-regular entries are skipped, never opened."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def check_model_folder(folder: Path) -> None:
    """Every file of a model folder that a loader reads is a regular file."""
    for name in FOLDER_FILES:
        if os.path.lexists(folder / name):
            require_regular(folder / name)
    for file in folder.glob("*.safetensors"):
        require_regular(file)
