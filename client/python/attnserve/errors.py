"""The one exception attnserve's client raises for a call the server (or gRPC) refused."""
import grpc


class AttnserveError(Exception):
    """A failed call: `code` is the grpc.StatusCode, `message` the server's words (they name the field, what
    arrived and what is allowed). str(): "INVALID_ARGUMENT: key: ..."."""

    def __init__(self, code, message, trace_id=""):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        # The server's trace id of the call when it traces (docs/tracing.md): where to find its trace.
        self.trace_id = trace_id

    @classmethod
    def from_rpc(cls, e):
        code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
        details = e.details() if callable(getattr(e, "details", None)) else str(e)
        trailing = e.trailing_metadata() if callable(getattr(e, "trailing_metadata", None)) else None
        trace_id = next((v for k, v in (trailing or ()) if k == "attnserve-trace-id"), "")
        return cls(code, details or "", trace_id)

    @classmethod
    def from_stream_error(cls, error):
        """An AttendStream answer's `error` (code number, message, the server's trace id)."""
        code = next((c for c in grpc.StatusCode if c.value[0] == error.code), grpc.StatusCode.UNKNOWN)
        return cls(code, error.message, error.trace_id)
