from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferHeader(_message.Message):
    __slots__ = ("run_id", "round", "sync_step", "sender", "digest", "size", "codec", "signature", "shard", "fragment")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEP_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    sync_step: int
    sender: str
    digest: str
    size: int
    codec: str
    signature: bytes
    shard: str
    fragment: int
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., sync_step: _Optional[int] = ..., sender: _Optional[str] = ..., digest: _Optional[str] = ..., size: _Optional[int] = ..., codec: _Optional[str] = ..., signature: _Optional[bytes] = ..., shard: _Optional[str] = ..., fragment: _Optional[int] = ...) -> None: ...

class DeltaChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: TransferHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[TransferHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("digest", "duplicate")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    digest: str
    duplicate: bool
    def __init__(self, digest: _Optional[str] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class MergeHeader(_message.Message):
    __slots__ = ("run_id", "round", "sync_step", "merge_step", "kind", "digest", "numel", "commitment", "members", "receipts", "fragment")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEP_FIELD_NUMBER: _ClassVar[int]
    MERGE_STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    sync_step: int
    merge_step: int
    kind: str
    digest: str
    numel: int
    commitment: str
    members: _containers.RepeatedScalarFieldContainer[str]
    receipts: _containers.RepeatedScalarFieldContainer[bytes]
    fragment: int
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., sync_step: _Optional[int] = ..., merge_step: _Optional[int] = ..., kind: _Optional[str] = ..., digest: _Optional[str] = ..., numel: _Optional[int] = ..., commitment: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., receipts: _Optional[_Iterable[bytes]] = ..., fragment: _Optional[int] = ...) -> None: ...

class MergeChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: MergeHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[MergeHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class MergeRequest(_message.Message):
    __slots__ = ("run_id", "requester", "sync_step", "kind", "fragment")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    requester: str
    sync_step: int
    kind: str
    fragment: int
    def __init__(self, run_id: _Optional[str] = ..., requester: _Optional[str] = ..., sync_step: _Optional[int] = ..., kind: _Optional[str] = ..., fragment: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("requester", "applied_step", "fragment")
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    APPLIED_STEP_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    requester: str
    applied_step: int
    fragment: int
    def __init__(self, requester: _Optional[str] = ..., applied_step: _Optional[int] = ..., fragment: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("run_id", "role", "round", "last_step", "state_digest", "done", "config_digest")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_DIGEST_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    role: str
    round: int
    last_step: int
    state_digest: str
    done: bool
    config_digest: str
    def __init__(self, run_id: _Optional[str] = ..., role: _Optional[str] = ..., round: _Optional[int] = ..., last_step: _Optional[int] = ..., state_digest: _Optional[str] = ..., done: _Optional[bool] = ..., config_digest: _Optional[str] = ...) -> None: ...

class MemberChange(_message.Message):
    __slots__ = ("run_id", "change", "member", "step", "signature", "issued")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    ISSUED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    change: str
    member: str
    step: int
    signature: bytes
    issued: int
    def __init__(self, run_id: _Optional[str] = ..., change: _Optional[str] = ..., member: _Optional[str] = ..., step: _Optional[int] = ..., signature: _Optional[bytes] = ..., issued: _Optional[int] = ...) -> None: ...

class MemberReply(_message.Message):
    __slots__ = ("duplicate", "has_start", "start", "message")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    HAS_START_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    has_start: bool
    start: int
    message: str
    def __init__(self, duplicate: _Optional[bool] = ..., has_start: _Optional[bool] = ..., start: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
