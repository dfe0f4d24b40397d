"""The dataferry wire format: pure message types, codecs, limits and the shared-memory batch layout.

Nothing here opens a socket or a file; both the service and the trainer side import it.
"""

from protocol.codec import decode, encode
from protocol.layout import SEGMENT_PREFIX, SlotLayout, validate_segment_name
from protocol.messages import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    BatchReady,
    Bye,
    EpochEnd,
    ErrorReply,
    FeedInfo,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    Release,
    Spoiled,
    Start,
    StatusReply,
    StatusRequest,
    Want,
    Welcome,
)
from protocol.workers import StopWorker, Task, TaskDone, WorkerReady

__all__ = [
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "SEGMENT_PREFIX",
    "BatchReady",
    "Bye",
    "EpochEnd",
    "ErrorReply",
    "FeedInfo",
    "Heartbeat",
    "Hello",
    "Message",
    "ProtocolError",
    "Release",
    "SlotLayout",
    "Spoiled",
    "Start",
    "StatusReply",
    "StatusRequest",
    "StopWorker",
    "Task",
    "TaskDone",
    "Want",
    "Welcome",
    "WorkerReady",
    "decode",
    "encode",
    "validate_segment_name",
]
