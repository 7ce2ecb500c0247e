"""One KV manager in its own process on a fleet host, driven over a pipe: the prefill or decode end of a KV
transfer between two hosts, for ``scripts/bench_kv_hosts.py`` and ``tests/fleet``.

The process holds a KV pool laid out as SmolLM2-135M's (``engine.kv_pool``, page-major, float32; prefill's
filled with seeded random values, decode's with 1.0), a manager of ``--backend`` that advertises
``--hostname``, and obeys ``(command, payload)`` tuples on an inherited pipe
(``multiprocessing.connection.Connection`` on fd ``--fd``); ``KVWorker`` is the parent's handle. Every wait
has a timeout; a command's answer reports failures (the room's ``failure`` text), never raises across the
pipe.

Commands: ``recv (room, pages, prefill_id)`` -> the receiver's state once published (or failed);
``wait (room, timeout_s)`` -> ``RoomResult`` at decode; ``send (room, pages, timeout_s, touch)`` ->
``RoomResult`` at prefill (``touch``: rewrite the pages first, as a forward pass would); ``digest pages`` ->
sha256 of those pages' bytes; ``metrics`` -> the manager's counters; ``stop``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PAGE_SIZE = 16
#: Enough pages for one 4k-token prompt at each end and some room (``[num_pages, page floats]``).
NUM_PAGES = 4096 // PAGE_SIZE + 8
MODEL_ID = "smollm2-135m"


@dataclass(frozen=True)
class RoomResult:
    """One room's end at one side: monotonic seconds of ``send`` (prefill) or of seeing the end (decode),
    the final ``KVPoll`` name, the failure text, whether its pages may be reused, and its timestamps."""

    t_s: float
    state: str
    failure: str
    releasable: bool
    timings: dict[str, Any]


def smollm2_layout(num_pages: int = NUM_PAGES) -> Any:
    from kv_transfer import KVLayout
    return KVLayout(num_layers=30, num_pages=num_pages, page_size=PAGE_SIZE, num_kv_heads=3, head_dim=64)


def _wait(pred: Callable[[], bool], timeout_s: float) -> bool:
    """Polls ``pred`` until it is true (True) or ``timeout_s`` passed (False), at ``poll_interval_s``'s pace
    (an end is seen at most ~5 % / 1 ms late; a serving engine loop waiting only on KV ticks every 2 ms,
    ``EngineLoop.busy_wait_s``, and once per step when busy). Until 2026-12-04 a fixed 50 us poll: it took
    CPU from Mooncake's I/O threads on 2 cores, and, since the decode side's ``poll`` drains the transport, it
    progressed NIXL's UCX worker 20,000 times a second, which no engine loop does (docs/multihost.md, "The
    decode side's pace")."""
    from kv_transfer.poll import poll_interval_s

    started_s = time.monotonic()
    while not pred():
        now_s = time.monotonic()
        if now_s - started_s > timeout_s:
            return False
        time.sleep(poll_interval_s(now_s - started_s))
    return True


#: The fleet secret of the harness's KV workers (a test fleet on a private bridge; never a real deployment's).
HARNESS_SECRET = "triton-pd-fleet-harness"

class _Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from bootstrap.auth import load_fleet_secret
        from engine.kv_pool import KVPool, KVShape
        from kv_transfer import KVArgs, make_kv_manager, parse_options
        from kv_transfer.nixl_transport import NixlOptions

        self._pool_owner = KVPool(KVShape(num_layers=30, num_kv_heads=3, head_dim=64, page_size=PAGE_SIZE),
                                  NUM_PAGES, torch.float32, "cpu", huge_pages=True)
        flat = self._pool_owner.storage.numpy().reshape(-1)   # [pool floats]
        flat[:] = np.random.default_rng(1).random(len(flat),
                                                  dtype=np.float32) if args.role == "prefill" else 1.0
        self.pages = flat.reshape(NUM_PAGES, -1)               # [num_pages, page floats], page-major
        kv_args = KVArgs(instance_id=args.instance_id, role=args.role, kv_base_ptr=flat.ctypes.data,
                         kv_nbytes=flat.nbytes, layout=smollm2_layout(), model_id=MODEL_ID,
                         local_hostname=args.hostname, fleet_secret=load_fleet_secret(os.environ),
                         waiting_timeout_s=args.waiting_timeout_s, bootstrap_timeout_s=args.waiting_timeout_s)
        # --network-only is NIXL's option; a backend without it (Mooncake, always over its network) ignores
        # it. Of the environment only NIXL's progress thread is read (an A/B of it); --local keeps its meaning
        progress_env = NixlOptions.ENV["progress_thread_ms"]
        environ = {progress_env: os.environ[progress_env]} if progress_env in os.environ else {}
        options = parse_options(args.backend, {"kv_network_only": "1"} if args.network_only else {}, environ)
        self.manager = make_kv_manager(kv_args, args.backend, options)
        self.rooms: dict[int, Any] = {}

    def recv(self, room: int, pages: list[int], prefill_id: str, prefill_url: str) -> str:
        from kv_transfer import KVPoll
        receiver = self.rooms[room] = self.manager.create_receiver(room, prefill_id, prefill_url)
        receiver.init(pages)
        _wait(lambda: receiver.poll() >= KVPoll.WaitingForInput or receiver.poll() == KVPoll.Failed, 30)
        return str(receiver.poll().name)

    def wait(self, room: int, timeout_s: float) -> RoomResult:
        from kv_transfer import KVPoll
        receiver = self.rooms.pop(room)
        _wait(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), timeout_s)
        t_s = time.monotonic()
        _wait(receiver.pages_releasable, 10)
        return RoomResult(t_s, receiver.poll().name, str(receiver.failure or ""), receiver.pages_releasable(),
                          vars(receiver.timings))

    def send(self, room: int, pages: list[int], timeout_s: float, touch: bool) -> RoomResult:
        from kv_transfer import AuxData, KVPoll
        sender = self.manager.create_sender(room)
        sender.init(len(pages))
        _wait(lambda: sender.poll() >= KVPoll.WaitingForInput or sender.poll() == KVPoll.Failed, timeout_s)
        if touch:   # a forward pass wrote these pages just now: the source is in cache, as in serving
            for page in pages:
                np.add(self.pages[page], 1.0, out=self.pages[page])
        t0_s = time.monotonic()
        if sender.poll() != KVPoll.Failed:
            sender.send(pages, True, AuxData(1, -0.1, room))
        _wait(sender.pages_releasable, timeout_s)
        return RoomResult(t0_s, sender.poll().name, str(sender.failure or ""), sender.pages_releasable(),
                          vars(sender.timings))

    def serve(self, conn: Connection) -> None:
        self.manager.start()
        conn.send(("ready", self.manager.agent_name, self.manager.rendezvous_url))
        while True:
            cmd, payload = conn.recv()
            if cmd == "stop":
                break
            if cmd == "recv":
                conn.send(self.recv(*payload))
            elif cmd == "wait":
                conn.send(asdict(self.wait(*payload)))   # a dict: this module is ``__main__`` here
            elif cmd == "send":
                conn.send(asdict(self.send(*payload)))
            elif cmd == "digest":
                conn.send(hashlib.sha256(self.pages[list(payload)].tobytes()).hexdigest())
            elif cmd == "metrics":
                conn.send(self.manager.metrics())
        self.manager.shutdown()
        conn.send("stopped")


class KVWorker:
    """The parent's handle of a worker process started on ``host`` (a ``fleet.netns.Host``) with
    ``Host.popen`` (``env``: extra environment, e.g. UCX variables); ``call`` sends one command and waits for
    its answer (``TimeoutError`` past ``timeout_s``)."""

    def __init__(self, host: Any, role: str, backend: str, network_only: bool = True,
                 instance_id: str = "", waiting_timeout_s: float = 30.0, log: Any = None,
                 env: dict[str, str] | None = None) -> None:
        import multiprocessing as mp
        self.parent, child = mp.Pipe()
        self.instance_id = instance_id or f"{role}-{host.name}"
        argv = [sys.executable, str(Path(__file__).resolve()), "--fd", str(child.fileno()), "--role", role,
                "--backend", backend, "--hostname", host.address,
                "--instance-id", self.instance_id, "--waiting-timeout-s", str(waiting_timeout_s)]
        argv += ["--network-only"] if network_only else []
        # the rendezvous binds the host's own (non-loopback) address: the fleet's calls are signed
        env = {"PD_FLEET_SECRET": HARNESS_SECRET, **(env or {})}
        self.proc: subprocess.Popen[bytes] = host.popen(argv, env=env, pass_fds=(child.fileno(),), stdout=log,
                                                        stderr=log)
        child.close()
        ready = self.call_raw(120.0)
        assert ready[0] == "ready", ready
        self.agent_name: str = ready[1]
        self.rendezvous_url: str = ready[2]   # the worker's own rendezvous, on its host's address

    def call_raw(self, timeout_s: float) -> Any:
        if not self.parent.poll(timeout_s):
            raise TimeoutError(f"worker {self.instance_id} did not answer in {timeout_s} s "
                               f"(exit code {self.proc.poll()})")
        answer = self.parent.recv()
        return RoomResult(**answer) if isinstance(answer, dict) and "releasable" in answer else answer

    def call(self, cmd: str, payload: Any = None, timeout_s: float = 60.0) -> Any:
        self.parent.send((cmd, payload))
        return self.call_raw(timeout_s)

    def post(self, cmd: str, payload: Any = None) -> None:
        """Sends a command without waiting; ``call_raw`` reads its answer later."""
        self.parent.send((cmd, payload))

    def stop(self, timeout_s: float = 20.0) -> None:
        try:
            self.call("stop", None, timeout_s)
        except (TimeoutError, OSError, EOFError):
            pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--backend", default="nixl")
    parser.add_argument("--hostname", required=True, help="the address this instance advertises")
    parser.add_argument("--instance-id", required=True)
    parser.add_argument("--network-only", action="store_true")
    parser.add_argument("--waiting-timeout-s", type=float, default=30.0)
    args = parser.parse_args(argv)
    conn = Connection(args.fd)
    os.set_inheritable(args.fd, False)
    _Worker(args).serve(conn)


if __name__ == "__main__":
    main()
