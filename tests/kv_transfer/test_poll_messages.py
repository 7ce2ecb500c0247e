"""Poll-state transitions, aux records, notification tags, the aux buffer and the in-process transport."""

from __future__ import annotations

import numpy as np
import pytest

from kv_transfer.aux import AUX_SLOT_BYTES, AuxData
from kv_transfer.auxbuf import AuxBuffer
from kv_transfer.blocks import BlockTable
from kv_transfer.inprocess import Fabric, InProcessTransport
from kv_transfer.layout import KVLayout
from kv_transfer.poll import KVPoll, advance
from kv_transfer.tags import Tag, TagKind, chunk_tag
from kv_transfer.transport import TransportError, XferState


def test_poll_states_are_ordered_and_only_move_forward() -> None:
    order = [KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success]
    assert order == sorted(order) and len(set(order)) == 5
    assert advance(KVPoll.Transferring, KVPoll.WaitingForInput) == KVPoll.Transferring
    assert advance(KVPoll.Bootstrapping, KVPoll.Transferring) == KVPoll.Transferring
    assert advance(KVPoll.Transferring, KVPoll.Failed) == KVPoll.Failed


@pytest.mark.parametrize("target", list(KVPoll))
def test_terminal_states_are_sticky(target: KVPoll) -> None:
    assert advance(KVPoll.Failed, target) == KVPoll.Failed
    assert advance(KVPoll.Success, target) == KVPoll.Success


def test_aux_round_trip_and_an_empty_slot_is_not_a_record() -> None:
    aux = AuxData(first_token_id=49151, first_logprob=-1.5, room=2**63 - 1)
    assert len(aux.pack()) == AUX_SLOT_BYTES and AuxData.unpack(aux.pack()) == aux
    assert AuxData.unpack(bytes(AUX_SLOT_BYTES)) is None


def test_tags_round_trip_and_unknown_messages_are_ignored() -> None:
    tag = chunk_tag(room=2**62, xfer_id="abc", chunk_index=3, total_chunks=4)
    assert Tag.decode(tag.encode()) == tag and tag.total_chunks == 4
    assert chunk_tag(1, "x", 0, 0).total_chunks == 0
    cancel = Tag.decode(Tag(TagKind.CANCEL, 5, "x", 0, "a|b").encode())
    assert cancel is not None and cancel.text == "a/b"
    assert Tag.decode(b"garbage") is None and Tag.decode(b"nope|1|x|0|") is None


def test_aux_buffer_hands_out_zeroed_slots_and_reads_back_records() -> None:
    buf = AuxBuffer(2)
    a, b = buf.alloc(), buf.alloc()
    assert {a, b} == {0, 1} and buf.alloc() is None
    assert a is not None
    buf.write(a, AuxData(1, 0.5, 9))
    assert buf.read(a) == AuxData(1, 0.5, 9)
    buf.free(a)
    assert buf.read(buf.alloc() or 0) is None


def test_inprocess_transport_copies_blocks_then_notifies() -> None:
    fabric = Fabric()
    # 8-byte blocks, 16-byte pages (page-major: page p is bytes [16 p, 16 p + 16), K then V)
    layout = KVLayout(num_layers=1, num_pages=4, page_size=1, num_kv_heads=1, head_dim=2)
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    aux_src, aux_dst = np.ones(32, dtype=np.uint8), np.zeros(32, dtype=np.uint8)
    src_table = BlockTable(src.ctypes.data, layout, aux_src.ctypes.data, 1)
    dst_table = BlockTable(dst.ctypes.data, layout, aux_dst.ctypes.data, 1)
    left, right = InProcessTransport("a", fabric), InProcessTransport("b", fabric)
    left.register(src_table)
    right.register(dst_table)
    peer = left.add_peer(right.metadata(), dst_table)
    local, remote = src_table.kv_indices([1]), dst_table.kv_indices([2])
    assert left.check(left.post_write(peer, local, remote, b"hi")) == XferState.DONE
    assert np.array_equal(dst[32:48], src[16:32])
    assert dst.sum() == src[16:32].sum()
    assert right.get_notifs() == [(left.agent_name, b"hi")]
    with pytest.raises(TransportError):
        left.post_write(peer, local, np.array([dst_table.aux_index(0)] * 2), b"size mismatch")
    right.close()
    with pytest.raises(TransportError):
        left.post_write(peer, local, remote, b"again")
