"""deploy/systemd: never root, a state folder the service's own user owns as the cache,
no key on a command line, and units systemd itself accepts (where systemd-analyze is)."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

UNITS = sorted((Path(__file__).resolve().parents[1] / "deploy" / "systemd").glob("*.service"))


def parse(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Sections -> (key, value) in order; repeated keys kept, continuation lines joined."""
    sections, current, text = {}, None, path.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
        else:
            key, _, value = line.partition("=")
            current.append((key.strip(), value.strip()))
    return sections


def test_both_units_exist():
    assert [u.name for u in UNITS] == ["pantheon-frontend.service", "pantheon-worker@.service"]


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_units_run_as_their_own_user_with_the_cache_in_their_state_folder(unit):
    service = parse(unit)["Service"]
    values = {}
    for key, value in service:
        values.setdefault(key, []).append(value)
    one = {k: v[-1] for k, v in values.items()}
    assert one.get("DynamicUser") == "yes" or one.get("User", "root") not in ("root", "0")
    assert one.get("User") == "pantheon" and one.get("Group") == "pantheon"
    env = dict(e.split("=", 1) for e in values.get("Environment", []))
    state = one["StateDirectory"]
    assert env["PANTHEON_CACHE_DIR"] == f"%S/{state}"      # writable by that user alone
    assert one.get("ProtectSystem") == "strict" and one.get("NoNewPrivileges") == "yes"
    assert not re.search(r"--(api-key|admin-key|key)[ =]", one["ExecStart"])


def test_systemd_accepts_the_units(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze")
    for unit in UNITS:             # the binary replaced by one that exists on this host
        text = unit.read_text().replace("/opt/pantheon/.venv/bin/pantheon", shutil.which("true"))
        (tmp_path / unit.name.replace("@.", "@cpu.")).write_text(text)
    done = subprocess.run(["systemd-analyze", "verify", "--man=no",
                           *map(str, sorted(tmp_path.iterdir()))],
                          capture_output=True, text=True, timeout=60)
    problems = [line for line in (done.stdout + done.stderr).splitlines()
                if "Unknown" in line or "Invalid" in line or "Failed" in line
                or "ignoring" in line]
    assert not problems, problems
