"""What the service and its trainers agree on: the message types, codecs and limits, the
shared-memory batch layout, the keys a CURVE client presents (``curve``), how a batch row's
pixels are made (``pixels``), so both sides make the same ones, and the body of a status reply with
the metrics it gives (``status``).

Both sides import it and it imports neither. Nothing here opens a socket, starts a thread or holds
process state (it may read a file it is handed, such as a key).
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
