"""API rules of managers, senders and receivers that need no peer: construction starts nothing, misuse fails
the one room with a typed error, configuration is validated."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from kv_harness import smollm2_layout

from kv_transfer import AuxData, KVArgs, KVManager, KVPoll, TransferError, make_kv_manager, unavailable_reason


def args_for(pool: np.ndarray, role: str = "prefill", **changes: object) -> KVArgs:
    fields: dict[str, object] = {"instance_id": f"rules-{role}", "role": role,
                                 "kv_base_ptr": pool.ctypes.data, "kv_nbytes": pool.nbytes,
                                 "layout": smollm2_layout(num_pages=4), "model_id": "m"}
    fields.update(changes)
    return KVArgs(**fields)  # type: ignore[arg-type]


@pytest.fixture
def pool() -> np.ndarray:
    layout = smollm2_layout(num_pages=4)
    return np.zeros(layout.pool_bytes // 4, dtype=np.float32)


@pytest.fixture
def prefill(pool: np.ndarray) -> Iterator[KVManager]:
    manager = make_kv_manager(args_for(pool), "inprocess")
    manager.start()
    yield manager
    manager.shutdown()


@pytest.mark.parametrize("backend", ["inprocess", pytest.param("nixl", marks=pytest.mark.nixl),
                                     pytest.param("mooncake", marks=pytest.mark.mooncake)])
def test_constructing_a_manager_starts_no_thread(pool: np.ndarray, backend: str) -> None:
    reason = unavailable_reason(backend)
    if reason is not None:
        pytest.skip(reason)
    before = threading.active_count(), len(os.listdir("/proc/self/task"))  # Python and native threads
    manager = make_kv_manager(args_for(pool), backend)
    assert (threading.active_count(), len(os.listdir("/proc/self/task"))) == before
    manager.shutdown()  # a never-started manager shuts down as a no-op


def test_send_before_init_fails_the_room_with_a_typed_error(prefill: KVManager) -> None:
    sender = prefill.create_sender(1)
    with pytest.raises(TransferError) as info:
        sender.send([0], True, AuxData(1, 0.0, 1))
    assert info.value.room == 1 and sender.poll() == KVPoll.Failed and sender.failure is not None


@pytest.mark.parametrize("calls", [[([0, 1], True, None)], [([0], False, None), ([1, 2], True, "aux")],
                                   [([0], True, "aux"), ([1], True, "aux")]])
def test_send_rules_whole_pages_then_last_with_aux(
        prefill: KVManager, calls: list) -> None:  # type: ignore[type-arg]
    sender = prefill.create_sender(2)
    sender.init(2)
    with pytest.raises(TransferError):
        for pages, is_last, aux in calls:
            sender.send(pages, is_last, AuxData(1, 0.0, 2) if aux else None)
    assert sender.poll() == KVPoll.Failed
    sender.send([0], True, AuxData(1, 0.0, 2))  # a no-op on a failed room
    assert sender.poll() == KVPoll.Failed


def test_a_second_sender_for_an_open_room_fails_alone(prefill: KVManager) -> None:
    first, second = prefill.create_sender(3), prefill.create_sender(3)
    assert second.poll() == KVPoll.Failed and first.poll() == KVPoll.Bootstrapping
    assert "in use" in str(second.failure)


def test_role_mismatch_and_bad_config_are_refused(pool: np.ndarray,
                                                  prefill: KVManager) -> None:
    with pytest.raises(TypeError):
        prefill.create_receiver(1, "x")
    with pytest.raises(ValueError, match="kv_nbytes"):
        args_for(pool[:-1])
    with pytest.raises(ValueError, match="role"):
        args_for(pool, role="both")
    with pytest.raises(ValueError, match="waiting_timeout_s"):
        args_for(pool, waiting_timeout_s=0)
    with pytest.raises(ValueError, match="backend"):
        make_kv_manager(args_for(pool), "tcp")


def test_an_unexpected_error_while_posting_fails_that_room_only(pool: np.ndarray) -> None:
    """The last chunk is posted in the caller's thread (an engine loop in serving): an unexpected error there
    (here the transport raises a RuntimeError once) must not escape ``send``; that room fails on both sides
    with its pages releasable, and the next room moves its KV."""
    decode_pool = np.zeros_like(pool)   # referenced until the end: the prefill side writes into it
    prefill = make_kv_manager(args_for(pool, instance_id="boom-p"), "inprocess")
    decode = make_kv_manager(args_for(decode_pool, role="decode", instance_id="boom-d"),
                             "inprocess")
    prefill.start()
    decode.start()
    inner = prefill._transport._inner  # type: ignore[attr-defined]
    real_post_write, raised = inner.post_write, []

    def post_write_once_broken(*args: object) -> object:
        if not raised:
            raised.append(True)
            raise RuntimeError("boom")
        return real_post_write(*args)

    inner.post_write = post_write_once_broken
    try:
        handles = {}
        for room, pages in ((11, [0, 1]), (12, [2, 3])):
            receiver = decode.create_receiver(room, "boom-p", prefill.rendezvous_url)
            receiver.init(pages)
            sender = prefill.create_sender(room)
            sender.init(2)
            _wait_for(lambda s=sender: s.poll() >= KVPoll.WaitingForInput)
            sender.send([0, 1], True, AuxData(5, -0.5, room))   # does not raise
            handles[room] = sender, receiver
        failed_sender, failed_receiver = handles[11]
        assert failed_sender.poll() == KVPoll.Failed and "boom" in str(failed_sender.failure)
        _wait_for(lambda: failed_receiver.poll() == KVPoll.Failed and failed_receiver.pages_releasable()
                  and failed_sender.pages_releasable())
        sender, receiver = handles[12]
        _wait_for(lambda: receiver.poll() == KVPoll.Success and sender.pages_releasable())
        assert receiver.aux == AuxData(5, -0.5, 12)
    finally:
        prefill.shutdown()
        decode.shutdown()


def _wait_for(predicate: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_backend_is_one_registration_and_names_are_unique(pool: np.ndarray) -> None:
    """The plugin point: a factory registered under a new name is selectable by that name (what ``kv_backend``
    in config.pbtxt passes), with nothing else edited; a taken name is refused; an unknown one is an error."""
    from kv_transfer import BackendOptions, BaseKVManager, option_parameters, parse_options, register_backend
    from kv_transfer.backends import backend_names
    from kv_transfer.inprocess import InProcessTransport

    made: list[str] = []

    @dataclasses.dataclass(frozen=True)
    class PluginOptions(BackendOptions):
        lanes: int = 1

    def factory(args: KVArgs, options: PluginOptions) -> InProcessTransport:
        made.append(f"{args.instance_id}/{options.lanes}")
        return InProcessTransport(args.instance_id)

    if "test-plugin" not in backend_names():
        register_backend("test-plugin", factory, PluginOptions)
    assert "test-plugin" in backend_names() and unavailable_reason("test-plugin") is None
    manager = make_kv_manager(args_for(pool, instance_id="plugin-p"), "test-plugin")
    assert isinstance(manager, BaseKVManager) and made[-1:] == ["plugin-p/1"]
    # its options are its own parameters, parsed by name: what serving does with config.pbtxt
    assert option_parameters()["kv_lanes"] == ("test-plugin",)
    options = parse_options("test-plugin", {"kv_lanes": "4", "kv_protocol": "rdma"})
    make_kv_manager(args_for(pool, instance_id="plugin-q"), "test-plugin", options)
    assert made[-1:] == ["plugin-q/4"]
    with pytest.raises(ValueError, match="takes PluginOptions"):
        make_kv_manager(args_for(pool), "test-plugin", BackendOptions())
    with pytest.raises(ValueError, match="registered already"):
        register_backend("test-plugin", factory, PluginOptions)
    with pytest.raises(ValueError, match="backend must be one of"):
        make_kv_manager(args_for(pool), "no-such-backend")
    assert {"nixl", "mooncake", "inprocess"} <= set(backend_names())
