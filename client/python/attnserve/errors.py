"""The one exception attnserve's client raises for a call the server (or gRPC) refused."""
import grpc


class AttnserveError(Exception):
    """A failed call: `code` is the grpc.StatusCode, `message` the server's words (they name the field, what
    arrived and what is allowed). str(): "INVALID_ARGUMENT: key: ..."."""

    def __init__(self, code, message):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, e):
        code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
        details = e.details() if callable(getattr(e, "details", None)) else str(e)
        return cls(code, details or "")

    @classmethod
    def from_stream_error(cls, error):
        """An AttendStream answer's `error` (code number and message)."""
        code = next((c for c in grpc.StatusCode if c.value[0] == error.code), grpc.StatusCode.UNKNOWN)
        return cls(code, error.message)
