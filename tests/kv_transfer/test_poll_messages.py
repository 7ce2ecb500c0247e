"""Poll-state transitions, aux records, notification tags, the aux buffer and the in-process transport."""

from __future__ import annotations

import numpy as np
import pytest

from kv_transfer.aux import AUX_SLOT_BYTES, AuxData
from kv_transfer.auxbuf import AuxBuffer
from kv_transfer.inprocess import Fabric, InProcessTransport
from kv_transfer.poll import KVPoll, advance
from kv_transfer.tags import Tag, TagKind, chunk_tag
from kv_transfer.transport import Region, TransportError, XferState


def test_poll_states_are_ordered_and_only_move_forward() -> None:
    assert KVPoll.Failed < KVPoll.Bootstrapping < KVPoll.WaitingForInput < KVPoll.Transferring < KVPoll.Success
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
    assert Tag.decode(Tag(TagKind.CANCEL, 5, "x", 0, "a|b").encode()).text == "a/b"
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


def test_inprocess_transport_copies_spans_then_notifies() -> None:
    fabric = Fabric()
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    left, right = InProcessTransport("a", fabric), InProcessTransport("b", fabric)
    left.register([Region(src.ctypes.data, 64)])
    right.register([Region(dst.ctypes.data, 64)])
    peer = left.add_peer(right.metadata())
    spans = np.array([[src.ctypes.data + 8, dst.ctypes.data + 16, 8]], dtype=np.int64)
    assert left.check(left.post_write(peer, spans, b"hi")) == XferState.DONE
    assert np.array_equal(dst[16:24], src[8:16]) and not dst[:16].any()
    assert right.get_notifs() == [(left.agent_name, b"hi")]
    right.close()
    with pytest.raises(TransportError):
        left.post_write(peer, spans, b"again")
