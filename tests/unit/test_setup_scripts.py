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
        assert sorted(p.name for p in clone.iterdir()) == ["scripts"]
