"""Real storage for the fault tests: a small tmpfs (a full disk) and a read-only run directory.

A tmpfs needs ``mount``, so root (or CAP_SYS_ADMIN): each helper returns the reason it cannot
when it cannot, and the tests skip with it. A read-only directory is a read-only mount where
mounting works — as root, ``chmod a-w`` does not stop a write, so it would test nothing — and
else a ``chmod 0o555`` directory, checked to refuse a write first.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def mount_tmpfs(path: Path, size_bytes: int) -> str | None:
    """Mount a tmpfs of ``size_bytes`` at ``path``; None, or why it could not."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root (the CI runs the suite as root)"
    kib = -(-size_bytes // 1024)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)], capture_output=True, text=True
    )
    return None if done.returncode == 0 else f"mount -t tmpfs failed: {done.stderr.strip() or done.returncode}"


def remount_readonly(path: Path) -> str | None:
    done = subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True, text=True)
    return None if done.returncode == 0 else f"mount -o remount,ro failed: {done.stderr.strip()}"


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def readonly_run_dir(base: Path) -> tuple[Path | None, str, str | None]:
    """An existing run directory no write can go into: (directory, mechanism, None) or (None, '', why not).
    The caller unmounts ``base / 'ro'`` when the mechanism is ``mount``."""
    mnt = base / "ro"
    if mount_tmpfs(mnt, 1 << 20) is None:
        (mnt / "run").mkdir()
        why = remount_readonly(mnt)
        if why is None:
            return mnt / "run", "mount", None
        unmount(mnt)
    run = base / "chmod" / "run"
    run.mkdir(parents=True)
    run.chmod(0o555)
    try:
        (run / "probe").write_text("x")
    except OSError:
        return run, "chmod", None
    (run / "probe").unlink()
    return None, "", "chmod 0o555 does not stop this user's writes (root) and a read-only tmpfs cannot be mounted"
