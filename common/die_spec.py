"""What a die is called on the command line (`worker --die`, `serve --spawn-workers`).

Both sides read it: the frontend checks its spawn list before starting anything, the
worker opens the die it names. A bad name stops either with the accepted forms.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

EMU_DEVICES = 8                  # emulated dies 0..7 (the reference host's eight)
EMU_MEMORY = 12 << 30            # a K80 die's 12 GB, unless the name gives a size
FORMS = ("cpu, cpu:N or cpu:LABEL (a further CPU die, e.g. cpu:1 or cpu:edge), a CUDA device number (0, 1, ...), or "
         f"emu:INDEX[:SIZE] (an emulated CUDA die, for tests and development: INDEX "
         f"0-{EMU_DEVICES - 1}, SIZE its memory with a unit, e.g. 512M or 2G; default 12G)")
LABEL = re.compile(r"[A-Za-z0-9_-]{1,64}")   # cpu:LABEL names a further CPU die
UNITS = {"K": 10, "M": 20, "G": 30, "T": 40}
SIZE = re.compile(r"(\d+(?:\.\d+)?)([KMGT])(?:i?B)?", re.IGNORECASE)


@dataclass(frozen=True)
class DieSpec:
    kind: str           # "cpu", "cuda" or "emu"
    index: int          # the CUDA (or emulated) ordinal; the CPU die's number (cpu:N)
    memory: int = 0     # an emulated die's bytes


def parse_die(text: str) -> DieSpec:
    """`cpu`, `cpu:1`, `cpu:edge`, `0`, `0:1` (a second worker on die 0), `emu:0`, `emu:1:2G`."""
    parts = text.strip().split(":")
    if parts[0] == "emu":
        return _emulated(text, parts[1:])
    if parts[0] == "cpu" and (len(parts) == 1 or len(parts) == 2 and LABEL.fullmatch(parts[1])):
        return DieSpec("cpu", int(parts[1]) if len(parts) == 2 and parts[1].isdigit() else 0)
    if parts[0].isdigit() and (len(parts) == 1 or len(parts) == 2 and parts[1].isdigit()):
        return DieSpec("cuda", int(parts[0]))
    raise ValueError(f"bad die {text!r}: a die is {FORMS}")


def _emulated(text: str, rest: list[str]) -> DieSpec:
    if not rest or len(rest) > 2 or not rest[0].isdigit() or \
            not 0 <= int(rest[0]) < EMU_DEVICES:
        raise ValueError(f"bad die {text!r}: an emulated die's index is 0-{EMU_DEVICES - 1}; "
                         f"a die is {FORMS}")
    memory = EMU_MEMORY
    if len(rest) == 2:
        found = SIZE.fullmatch(rest[1])
        memory = int(float(found[1]) * (1 << UNITS[found[2].upper()])) if found else 0
        if memory < 1 << 20:
            raise ValueError(f"bad die {text!r}: an emulated die's size is at least 1M, with "
                             f"a unit (K, M, G, T); a die is {FORMS}")
    return DieSpec("emu", int(rest[0]), memory)
