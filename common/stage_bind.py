"""`pantheon worker --stage-bind HOST[:PORT[-PORT]]`: where a tcp stage link of a split
replica binds when this worker holds its second stage (worker/stage_socket.py binds it).
Here, not in worker/, because the option table (common/options.py) parses it."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class StageBind:
    """`--stage-bind HOST[:PORT[-PORT]]`: where a tcp stage link of this worker binds."""

    host: str = ""                            # "": the address toward the frontend
    ports: tuple[int, int] | None = None      # None: any free port

    @classmethod
    def parse(cls, text: str) -> "StageBind":
        text = text.strip()
        if text.startswith("["):                          # [v6]:PORT
            host, _, rest = text[1:].partition("]")
            ports = rest[1:] if rest.startswith(":") else ""
            if rest and not rest.startswith(":"):
                raise ValueError(f"bad --stage-bind {text!r}: want [V6]:PORT")
        elif text.count(":") == 1:
            host, ports = text.split(":")
        else:
            host, ports = text, ""
        if host:
            try:
                ipaddress.ip_address(host)
            except ValueError:
                if not all(part.isalnum() or "-" in part for part in host.split(".")):
                    raise ValueError(f"bad --stage-bind host {host!r}") from None
        if not ports:
            return cls(host, None)
        low, _, high = ports.partition("-")
        try:
            a, b = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"bad --stage-bind port {ports!r}: want PORT or LOW-HIGH") from None
        if not 1 <= a <= b <= 65535:
            raise ValueError(f"bad --stage-bind ports {ports!r}: 1 <= LOW <= HIGH <= 65535")
        return cls(host, (a, b))

    def text(self) -> str:
        """The flag's text again (what `serve --stage-bind` hands its spawned workers)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.ports is None:
            return host
        a, b = self.ports
        return f"{host}:{a}" + (f"-{b}" if b != a else "")
