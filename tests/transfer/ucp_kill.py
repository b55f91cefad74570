"""Die in the middle of a UCX send: after the transport took the message's slot
at the receiver, before the message is marked written.

The send goes through UCX's generic datatype, whose pack callback UCX calls
while the slot is held (for a shared-memory transport: a claimed element of the
receiver's FIFO); the callback writes a few bytes and SIGKILLs this process.
That is the worst moment for a peer to die, and the only one a kill from
outside hits rarely enough (the slot is held for a memcpy) to make the harm it
does hard to reproduce.
"""

from __future__ import annotations

import ctypes
import os
import signal

_C = ctypes
_START = _C.CFUNCTYPE(_C.c_void_p, _C.c_void_p, _C.c_void_p, _C.c_size_t)
_SIZE = _C.CFUNCTYPE(_C.c_size_t, _C.c_void_p)
_PACK = _C.CFUNCTYPE(_C.c_size_t, _C.c_void_p, _C.c_size_t, _C.c_void_p, _C.c_size_t)
_UNPACK = _C.CFUNCTYPE(_C.c_int, _C.c_void_p, _C.c_size_t, _C.c_void_p, _C.c_size_t)
_FINISH = _C.CFUNCTYPE(None, _C.c_void_p)


class _GenericOps(_C.Structure):  # ucp_generic_dt_ops_t
    _fields_ = [
        ("start_pack", _START),
        ("start_unpack", _START),
        ("packed_size", _SIZE),
        ("pack", _PACK),
        ("unpack", _UNPACK),
        ("finish", _FINISH),
    ]


class _RequestParam(_C.Structure):  # ucp_request_param_t (room to spare at the end)
    _fields_ = [
        ("op_attr_mask", _C.c_uint32),
        ("flags", _C.c_uint32),
        ("request", _C.c_void_p),
        ("cb", _C.c_void_p),
        ("datatype", _C.c_uint64),
        ("user_data", _C.c_void_p),
        ("reply_buffer", _C.c_void_p),
        ("memory_type", _C.c_int),
        ("recv_info", _C.c_void_p),
        ("memh", _C.c_void_p),
        ("spare", _C.c_uint8 * 64),
    ]


UCP_OP_ATTR_FIELD_DATATYPE = 1 << 3


def die_in_send(ucp_ep: int, nbytes: int = 4096, tag: int = 0xDEAD) -> None:
    """Send ``nbytes`` on the UCP endpoint handle ``ucp_ep``; the process dies
    inside the send (this returns only if UCX never packs the message)."""
    import libucx

    lib = _C.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so.0"))

    def pack(_state, _offset, dest, max_length):
        _C.memset(dest, 0xAB, min(max_length, 64))  # a few bytes written, then gone
        os.kill(os.getpid(), signal.SIGKILL)
        return 0

    ops = _GenericOps(
        _START(lambda _ctx, _buf, _count: 1),
        _START(lambda _ctx, _buf, _count: 1),
        _SIZE(lambda _state: nbytes),
        _PACK(pack),
        _UNPACK(lambda *_args: 0),
        _FINISH(lambda _state: None),
    )
    datatype = _C.c_uint64()
    lib.ucp_dt_create_generic.argtypes = [
        _C.POINTER(_GenericOps),
        _C.c_void_p,
        _C.POINTER(_C.c_uint64),
    ]
    if lib.ucp_dt_create_generic(_C.byref(ops), None, _C.byref(datatype)) != 0:
        raise RuntimeError("ucp_dt_create_generic failed")
    param = _RequestParam(op_attr_mask=UCP_OP_ATTR_FIELD_DATATYPE, datatype=datatype.value)
    lib.ucp_tag_send_nbx.restype = _C.c_void_p
    lib.ucp_tag_send_nbx.argtypes = [
        _C.c_void_p,
        _C.c_void_p,
        _C.c_size_t,
        _C.c_uint64,
        _C.POINTER(_RequestParam),
    ]
    lib.ucp_tag_send_nbx(ucp_ep, None, 1, tag, _C.byref(param))
    _KEEP.append(ops)  # should UCX pack later, from progress
    raise RuntimeError("UCX did not pack the message inside the send")


_KEEP: list = []
