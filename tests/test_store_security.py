"""The rendezvous store keeps to the job: it listens on loopback (the address the peers were
told), and a client that does not prove it knows the job's secret is refused before a byte
reaches the store (distributed/storeauth.py).

Real TCPStores, real sockets and, for the group, real processes on gloo. What listens where
is read from the kernel (psutil, /proc/net/tcp), not from the code's own bookkeeping.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from resilient_train.distributed import DistributedConfigError, storeauth
from resilient_train.distributed.rendezvous import Rendezvous
from resilient_train.launcher.ports import free_port
from resilient_train.launcher.workerenv import SECRET_ENV, JobEnv, Replica, worker_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the socket filter and the peer check are Linux's")

SECRET = "s3cret-" + "ab" * 16
PAIR = Path(__file__).parent / "init_workers" / "gated_pair.py"


def _ms(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _listeners(pid: int) -> list[tuple[str, int]]:
    return sorted((c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
                  if c.status == psutil.CONN_LISTEN)


@pytest.fixture
def primary(monkeypatch: pytest.MonkeyPatch) -> Iterator[Rendezvous]:
    """Rank 0 of 2, hosting the store on 127.0.0.1, with the job's secret."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    monkeypatch.delenv(storeauth.AGENT_STORE_ENV, raising=False)
    r = Rendezvous(host="127.0.0.1", port=free_port(), rank=0, world_size=2, hosts_store=True,
                   namespace="sec", name_of=lambda i: f"replica{i}", join_timeout_s=30)
    r.connect(time.monotonic() + 30)
    try:
        yield r
    finally:
        r.store = None


def _inner_port(r: Rendezvous) -> int:
    ports = {port for ip, port in _listeners(os.getpid())} & storeauth.listening_ports()
    (inner,) = ports - {r.port}
    return inner


def test_the_store_listens_on_loopback_only(primary: Rendezvous) -> None:
    ours = [(ip, port) for ip, port in _listeners(os.getpid())
            if port in storeauth.listening_ports()]
    # The job's port and the TCPStore server behind it, both on 127.0.0.1: no wildcard.
    assert len(ours) == 2 and primary.port in {port for _, port in ours}, ours
    assert {ip for ip, _ in ours} == {"127.0.0.1"}, ours
    # Cross-check with the kernel's table: nothing on the store's ports but 127.0.0.1.
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    lines += Path("/proc/net/tcp6").read_text().splitlines()[1:]
    bound = {f[1] for f in (line.split() for line in lines)
             if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) in {p for _, p in ours}}
    assert bound == {f"0100007F:{p:04X}" for _, p in ours}, bound


def test_a_client_without_the_secret_can_neither_read_nor_bump(primary: Rendezvous) -> None:
    import torch.distributed as dist

    keys_before = primary.store.num_keys()
    # A plain TCPStore client (what the outsider used) never gets an answer.
    with pytest.raises((RuntimeError, OSError)):
        stranger = dist.TCPStore("127.0.0.1", primary.port, is_master=False, timeout=_ms(1.0),
                                 wait_for_workers=False)
        stranger.add("sec/gen", 1)
    # A client that guesses the answer is disconnected without a byte from the store.
    with socket.create_connection(("127.0.0.1", primary.port), timeout=10) as raw:
        greeting = storeauth._recv_exact(raw, len(storeauth.GREETING) + storeauth.NONCE_BYTES,
                                         time.monotonic() + 10)
        assert greeting.startswith(storeauth.GREETING)
        raw.sendall(b"\0" * (storeauth.NONCE_BYTES + storeauth.MAC_BYTES))
        assert raw.recv(100) == b""
    # The protocol's own client with a wrong secret is told so.
    with pytest.raises(storeauth.StoreAuthError, match="refused this process's secret"):
        storeauth.forward("127.0.0.1", primary.port, b"not the job's secret",
                          storeauth.Relays(), connect_timeout_s=5)
    # The server behind the gate drops connections that are not the gate's own.
    with pytest.raises(TimeoutError), socket.socket() as direct:
        direct.settimeout(1.0)
        direct.connect(("127.0.0.1", _inner_port(primary)))
    assert primary.generation() == 0
    assert primary.store.num_keys() == keys_before
    # With the secret: the same keys, through the gate.
    worker = Rendezvous(host="127.0.0.1", port=primary.port, rank=1, world_size=2,
                        hosts_store=False, namespace="sec", name_of=lambda i: f"replica{i}",
                        join_timeout_s=30)
    worker.connect(time.monotonic() + 10)
    assert worker.epoch == primary.epoch and worker.generation() == 0
    worker.store.set("sec/from-worker", "1")
    assert primary.store.get("sec/from-worker") == b"1"
    worker.store = None


def test_a_client_does_not_trust_a_store_that_lacks_the_secret() -> None:
    # An impostor on the job's port (it took the port before the primary, say) answers the
    # greeting but cannot prove the secret: the client refuses to use it.
    with socket.socket() as impostor:
        impostor.bind(("127.0.0.1", 0))
        impostor.listen(1)

        def serve() -> None:
            conn, _ = impostor.accept()
            with conn:
                conn.sendall(storeauth.GREETING + os.urandom(storeauth.NONCE_BYTES))
                storeauth._recv_exact(conn, storeauth.NONCE_BYTES + storeauth.MAC_BYTES,
                                      time.monotonic() + 10)
                conn.sendall(os.urandom(storeauth.MAC_BYTES))

        t = threading.Thread(target=serve)
        t.start()
        with pytest.raises(storeauth.StoreAuthError, match="does not know this job's secret"):
            storeauth.forward("127.0.0.1", impostor.getsockname()[1], SECRET.encode(),
                              storeauth.Relays(), connect_timeout_s=5)
        t.join(10)


def test_a_forwarder_serves_its_own_process_only(primary: Rendezvous) -> None:
    import torch.distributed as dist

    relays = storeauth.Relays()
    port = storeauth.forward("127.0.0.1", primary.port, SECRET.encode(), relays,
                             connect_timeout_s=5)
    # Another local process finds the forwarder's port: it is cut off at once.
    probe = subprocess.run(
        [sys.executable, "-c",
         "import socket,sys\n"
         f"s=socket.create_connection(('127.0.0.1',{port}),timeout=10)\n"
         "s.sendall(b'x'*16)\n"
         "try:\n"
         "    data=s.recv(100)\n"
         "except ConnectionResetError:\n"
         "    data=b''\n"
         "sys.stdout.write(repr(data))"],
        capture_output=True, text=True, timeout=60)
    assert probe.stdout == "b''", probe.stderr   # closed, without a byte of the store
    # This process's own TCPStore client still gets through.
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_ms(5),
                          wait_for_workers=False)
    assert store.get("sec/gen") == b"0"
    del store
    relays.close()


def test_someone_who_reached_the_store_before_it_was_sealed_is_caught() -> None:
    import torch.distributed as dist

    gate = storeauth.StoreGate(["127.0.0.1"], free_port(), SECRET.encode())
    try:
        store = dist.TCPStore("127.0.0.1", gate.inner_port, is_master=True,
                              master_listen_fd=gate.inner_fd(), wait_for_workers=False)
        # Another process connects in the moment between listen() and the filter.
        holder = subprocess.Popen(
            [sys.executable, "-c",
             "import socket,sys,time\n"
             f"s=socket.create_connection(('127.0.0.1',{gate.inner_port}))\n"
             "print('in',flush=True)\n"
             "sys.stdin.read()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "in\n"
            with pytest.raises(storeauth.StoreTamperedError, match="before it was sealed"):
                gate.seal(store)
        finally:
            holder.kill()
            holder.wait()
    finally:
        gate.close()
    # Keys that someone left behind (and went) are caught too.
    gate = storeauth.StoreGate(["127.0.0.1"], free_port(), SECRET.encode())
    try:
        store = dist.TCPStore("127.0.0.1", gate.inner_port, is_master=True,
                              master_listen_fd=gate.inner_fd(), wait_for_workers=False)
        store.set("planted", "1")
        with pytest.raises(storeauth.StoreTamperedError, match="keys left behind"):
            gate.seal(store)
    finally:
        gate.close()


def _start(rank: int, life: int, port: int, ready: Path) -> tuple[subprocess.Popen[str], Any]:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               LIFE=str(life), READY_DIR=str(ready), CLOUD_ML_JOB_ID=f"sec-{port}",
               **{SECRET_ENV: SECRET})
    for var in ("CLUSTER_SPEC", "TF_CONFIG", storeauth.AGENT_STORE_ENV):
        env.pop(var, None)
    out = tempfile.TemporaryFile("w+")
    return subprocess.Popen([sys.executable, str(PAIR)], env=env, text=True, stdout=out,
                            stderr=subprocess.STDOUT), out


def _wait_for(path: Path, procs: list[subprocess.Popen[str]], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        assert all(p.poll() is None for p in procs), "a rank exited early"
        time.sleep(0.05)


def _result(proc: subprocess.Popen[str], out: Any) -> dict[str, Any]:
    proc.wait(timeout=120)
    out.seek(0)
    text = out.read()
    lines = [line for line in text.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, text[-3000:]
    return dict(json.loads(lines[-1]))


@pytest.mark.slow
def test_a_gated_group_listens_on_loopback_and_reforms_after_a_restart(
        tmp_path: Path) -> None:
    port = free_port()
    (p0, out0), (p1, out1) = _start(0, 0, port, tmp_path), _start(1, 0, port, tmp_path)
    try:
        _wait_for(tmp_path / "rank-0.life-0", [p0, p1])
        _wait_for(tmp_path / "rank-1.life-0", [p0, p1])
        # Every listener of the job (the gate, the store, gloo's): 127.0.0.1 only.
        for proc in (p0, p1):
            listening = _listeners(proc.pid)
            assert listening and {ip for ip, _ in listening} == {"127.0.0.1"}, listening
        assert ("127.0.0.1", port) in _listeners(p0.pid)
        # An outsider tries to bump the generation while the group trains: refused.
        with pytest.raises((RuntimeError, OSError)):
            import torch.distributed as dist

            dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_ms(1.0),
                          wait_for_workers=False).add(f"rt/sec-{port}/gen", 1)
        (tmp_path / "die").touch()
        assert p1.wait(timeout=60) == 9
        p1, out1 = _start(1, 1, port, tmp_path)   # the restarted peer
        r1, r0 = _result(p1, out1), _result(p0, out0)
    finally:
        for p in (p0, p1):
            if p.poll() is None:
                p.kill()
    # One re-forming, caused by the restart alone (an outsider's bump would show as a
    # second generation or recovery).
    assert r0 == {"rank": 0, "generation": 1, "recoveries": 1}
    assert r1 == {"rank": 1, "generation": 1, "recoveries": 0}


# --- the secret and the address -------------------------------------------------------------

def test_the_launcher_hands_every_replica_one_secret_that_it_records_nowhere() -> None:
    replicas = (Replica("workerpool0-0", "workerpool0", 0, 0),
                Replica("workerpool1-0", "workerpool1", 0, 1))
    job = JobEnv(job_id="j", replicas=replicas, master_addr="127.0.0.1", master_port=29500,
                 output_base="/tmp/o", job_dir="/tmp/j")
    envs = [worker_env(job, r, attempt=1, restart=0, error_file="e", gpu_ids=None, base={})
            for r in replicas]
    secrets = {env[SECRET_ENV] for env in envs}
    assert len(secrets) == 1 and len(secrets.pop()) == 64
    assert job.job_secret not in repr(job)
    other = JobEnv(job_id="j", replicas=replicas, master_addr="127.0.0.1", master_port=29500,
                   output_base="/tmp/o", job_dir="/tmp/j")
    assert other.job_secret != job.job_secret   # one per launch
    # A secret the user set (the job spec's env) is kept, as on the platform.
    mine = worker_env(job, replicas[1], attempt=1, restart=0, error_file="e", gpu_ids=None,
                      base={SECRET_ENV: SECRET})
    assert mine[SECRET_ENV] == SECRET
    assert SECRET_ENV == storeauth.SECRET_ENV
    assert envs[0]["GLOO_SOCKET_IFNAME"] == "lo"   # gloo's listeners on loopback too


def test_the_secret_is_checked_and_derived_when_unset(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(DistributedConfigError, match="at least 16"):
        storeauth.job_secret("rt/j", {SECRET_ENV: "short"})
    assert storeauth.job_secret("rt/j", {SECRET_ENV: SECRET}) == SECRET.encode()
    derived = storeauth.job_secret("rt/j", {})
    assert derived == storeauth.job_secret("rt/j", {}) != storeauth.job_secret("rt/k", {})


def test_the_gate_binds_the_address_the_peers_were_told_never_the_wildcard() -> None:
    assert storeauth.bind_addresses("127.0.0.1", ["127.0.0.1"], {}) == ["127.0.0.1"]
    assert storeauth.bind_addresses("localhost", ["127.0.0.1", "::1"], {}) == [
        "127.0.0.1", "::1"]
    # The machine's own name mapped to 127.0.1.1 by /etc/hosts: its peers resolve it to a
    # real address, which is listened on too (each one named, still no wildcard).
    own = storeauth.bind_addresses("myhost", ["127.0.1.1"], {})
    up = {name for name, st in psutil.net_if_stats().items() if st.isup}
    real = [a.address for name, addrs in psutil.net_if_addrs().items() if name in up
            for a in addrs if a.family == socket.AF_INET and not a.address.startswith("127.")]
    assert own[0] == "127.0.1.1" and set(real) <= set(own[1:])
    assert not {"0.0.0.0", "::"} & set(own)
    with pytest.raises(DistributedConfigError, match="not an address of this machine"):
        storeauth.bind_addresses("x", ["127.0.0.1"], {storeauth.BIND_ENV: "192.0.2.7"})
    # A name that resolves elsewhere (a load balancer): the address this machine sends
    # from toward it, or a clear error; never the wildcard.
    try:
        chosen = storeauth.bind_addresses("lb.example", ["192.0.2.7"], {})
    except DistributedConfigError as exc:
        assert "none of which is an address of this machine" in str(exc)
    else:
        local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
        assert len(chosen) == 1 and chosen[0] in local and chosen[0] not in ("0.0.0.0", "::")
