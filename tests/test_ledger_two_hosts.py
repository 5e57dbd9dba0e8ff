"""Engines on two "hosts" share one root: separate UTS and PID namespaces (``unshare -u -p
-f``), other host names, the same pid (each is pid 1 of its namespace).

Liveness is the owner's lease (a held ``flock`` on one kernel, else its heartbeat), never
``[host, pid]``: engine B on host
``kv-b`` leaves engine A's pending reservation alone while A lives, though A's pid (1) is
B's own and A's host is not B's; once A is SIGKILLed, the next engine's first lock
acquisition reclaims it.  Each reads the other's files; the root stays within its budget.
Needs root (CI runs as root) and util-linux's ``unshare``.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_ledger_state_machine import BUDGET, root_bytes

REPO = str(Path(__file__).resolve().parents[1])

ACTOR = r"""
import json, os, socket, sys, time
sys.path[:0] = [{repo!r}, {repo!r} + "/tests"]
from pathlib import Path
from test_ledger_state_machine import Engine, KEY_BYTES, _name_of, _prompt_chunks, _write_whole
root, mode, flock = Path({root!r}), {mode!r}, {flock!r}
if flock == "none":  # a file system without flock: the held lock and heartbeats alone
    import errno, fcntl
    def no_flock(fd, how):
        raise OSError(errno.ENOLCK, "No locks available")
    fcntl.flock = no_flock
e = Engine(root, mode, lease_s={lease_s!r})
e.start()
def store(prompt, write=_write_whole):
    chunks, positions = _prompt_chunks(prompt)
    out = e.tier.reserve(chunks[:1], lambda ks: str(root / _name_of(ks)),
                         lambda ks: KEY_BYTES * len(ks), positions)
    for path, keys in out or []:
        write(path, keys)
    return [p for p, _ in out or []]
report = {{"pid": os.getpid(), "host": socket.gethostname(), "owner": e.ledger.owner,
          "flock_works": e.ledger.lease.flock_works}}
if mode == "a":
    paths = store(1)
    e.tier.complete([(p, True) for p in paths])
    def half(path, keys):
        with open(path + ".1-1-dead.tmp", "wb") as f:
            f.write(b"\0" * 100)
    report["files"] = paths
    report["pending"] = store(3, half)
    print(json.dumps(report), flush=True)
    time.sleep(600)
else:
    paths = store({prompt})
    e.tier.complete([(p, True) for p in paths])
    e.ledger.sync()
    report["files"] = paths
    report["seen"] = {{p: ok for p, ok in e.ledger.files().items()}}
    mine = {{os.path.relpath(p, root) for p in paths}}
    report["read"] = {{p: len(Path(root, p).read_bytes()) for p, ok in e.ledger.files().items()
                      if ok and p not in mine}}
    report["reclaimed"] = e.ledger.counters.as_dict()["reservations_reclaimed"]
    print(json.dumps(report), flush=True)
"""


def _unshare_available() -> str | None:
    if os.geteuid() != 0:
        return "needs root for new UTS and PID namespaces (CI runs as root)"
    if shutil.which("unshare") is None:
        return "util-linux's unshare is not installed"
    probe = subprocess.run(["unshare", "-u", "-p", "-f", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"unshare -u -p -f is refused here: {probe.stderr.decode().strip()}"
    return None


LEASE_S = 1.0
"""The engines' lease here: a killed engine is silent for this long before a peer on a file
system without ``flock`` reclaims it."""


def _host(root: Path, host: str, mode: str, prompt: int = 5,
          flock: str = "flock") -> subprocess.Popen[str]:
    code = ACTOR.format(repo=REPO, root=str(root), mode=mode, prompt=prompt, flock=flock,
                        lease_s=LEASE_S)
    return subprocess.Popen(
        ["unshare", "-u", "-p", "-f", "sh", "-c", f'hostname {host} && exec "$0" -c "$1"',
         sys.executable, code],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _report(proc: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            proc.kill()
            raise TimeoutError(f"no report in {timeout} s: {proc.stderr.read() if proc.stderr else ''}")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the engine exited ({proc.wait()}): {proc.stderr.read() if proc.stderr else ''}")
    report: dict[str, Any] = json.loads(line)
    return report


@pytest.mark.parametrize("flock", ["flock", "none"])
def test_two_hosts_with_colliding_pids_share_one_root(tmp_path: Path, flock: str) -> None:
    """``none``: the file system has no ``flock`` (``ENOLCK``); liveness is the heartbeat,
    and the killed engine is reclaimed once its lease has been silent for ``LEASE_S``."""
    why = _unshare_available()
    if why is not None:
        pytest.skip(why)
    root = tmp_path / "shared-volume"
    root.mkdir()
    a = _host(root, "kv-a", "a", flock=flock)
    try:
        ra = _report(a)
        time.sleep(2 * LEASE_S if flock == "none" else 0)  # A's heartbeat keeps it alive
        b = _host(root, "kv-b", "b", prompt=5, flock=flock)
        rb = _report(b)
        assert b.wait(60) == 0
        assert ra["pid"] == rb["pid"] == 1, (ra, rb)
        assert (ra["host"], rb["host"]) == ("kv-a", "kv-b")
        assert ra["flock_works"] is rb["flock_works"] is (flock == "flock"), (ra, rb)
        pending = os.path.relpath(ra["pending"][0], root)
        assert rb["seen"].get(pending) is False and rb["reclaimed"] == 0, (
            f"B reclaimed live A's reservation (same pid, other host): {rb}")
        a_files = [os.path.relpath(p, root) for p in ra["files"]]
        assert a_files and all(rb["read"].get(p, 0) > 0 for p in a_files), rb["read"]
        assert root_bytes(root) <= BUDGET
    finally:
        os.killpg(a.pid, signal.SIGKILL)
        a.wait(60)
    if flock == "none":
        time.sleep(LEASE_S + 0.5)  # A's lease falls silent
    c = _host(root, "kv-c", "b", prompt=7, flock=flock)
    rc = _report(c)
    assert c.wait(60) == 0
    assert rc["pid"] == 1 and rc["reclaimed"] >= 1, rc
    assert pending not in rc["seen"], f"the killed engine's reservation survived: {rc}"
    assert not list(root.rglob("*.tmp")), "the killed engine's temporary file survived"
    b_files = [os.path.relpath(p, root) for p in rb["files"]]
    assert all(rc["read"].get(p, 0) > 0 for p in b_files if p in rc["seen"]), rc
    assert root_bytes(root) <= BUDGET
