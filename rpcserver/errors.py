"""Errors a core raises for a caller's mistake or a capacity limit; servers map them to gRPC status codes."""


class ServiceError(Exception):
    """Base class: the message is meant for the client and must say what to do."""


class InvalidArgument(ServiceError):
    """The request is malformed or out of range (gRPC INVALID_ARGUMENT)."""


class ResourceExhausted(ServiceError):
    """A capacity limit was hit; the client may retry later (gRPC RESOURCE_EXHAUSTED)."""


class Unavailable(ServiceError):
    """The service cannot serve right now, e.g. shutting down (gRPC UNAVAILABLE)."""


class NotFound(ServiceError):
    """What the request names does not exist (gRPC NOT_FOUND)."""


class FailedPrecondition(ServiceError):
    """The service is not in a state to do this, e.g. a feature it was started without (gRPC FAILED_PRECONDITION)."""
