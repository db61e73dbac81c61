"""One guard in front of every trainguard gRPC service (node agent, coordinator): bad bytes never reach a handler.

A server interceptor re-wraps each method of the guarded service so that the handler receives the request
*bytes* first:

1. more than ``max_request_bytes`` -> INVALID_ARGUMENT, before anything is parsed (gRPC's own transport cap,
   ``grpc.max_receive_message_length``, still drops far larger messages with RESOURCE_EXHAUSTED);
2. bytes that do not parse as the request message -> INVALID_ARGUMENT, one status per request and no traceback
   in the log (gRPC's own deserializer answers INTERNAL and logs an ERROR traceback per request);
3. a per-method range check (``validators``) that finds a problem -> INVALID_ARGUMENT naming the field;
4. more than ``max_watchers`` concurrent server streams, or more than ``max_remote_watchers`` of them from
   network peers -> RESOURCE_EXHAUSTED.

Each finished call can be reported to an observer (method, status code, seconds) for metrics. The services'
own checks live beside them (``trainguard.agent.rpc_limits``, ``trainguard.recovery.service``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc
from google.protobuf.message import DecodeError

#: A range check of a decoded request: returns a problem (one line naming the field), or None.
Validator = Callable[[Any], "str | None"]

#: Observer of finished calls: (method short name, status code name, seconds or None for streams).
CallObserver = Callable[[str, str, "float | None"], None]


class RequestGuard(grpc.ServerInterceptor):
    """Server interceptor enforcing the checks of the module docstring on one gRPC service's methods."""

    def __init__(
        self,
        service: str,
        max_request_bytes: int,
        max_watchers: int = 0,
        observer: CallObserver | None = None,
        validators: Mapping[str, Validator] | None = None,
        max_remote_watchers: int = 0,
    ) -> None:
        """Creates the guard.

        Args:
            service: full name of the guarded service (``trainguard.v1.NodeAgent``); other services pass.
            max_request_bytes: largest accepted request, in bytes.
            max_watchers: concurrent server-streaming calls allowed (0: no limit).
            observer: called once per finished call with (method, status code name, seconds or None).
            validators: per-method range checks of the decoded request (full method name -> check).
            max_remote_watchers: of those, how many peers over the network (TCP) may hold at once (0: all); the
                rest stay for unix-socket peers. The node agent's TCP port needs no credentials, so without it
                any local user could hold every stream and cut the launchers (unix socket) off node events.
        """
        self.service = service
        self.max_request_bytes = max_request_bytes
        self._streams = threading.BoundedSemaphore(max_watchers) if max_watchers > 0 else None
        self._max_remote = max_remote_watchers
        self._remote = 0
        self._remote_lock = threading.Lock()
        self._observer = observer
        self._validators: Mapping[str, Validator] = validators or {}

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        method: str = details.method
        if handler is None or not method.startswith(f"/{self.service}/"):
            return handler
        short = method.rsplit("/", 1)[-1]
        check = self._validators.get(method)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, handler.request_deserializer, check, short),
                request_deserializer=None,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, handler.request_deserializer, check, short),
                request_deserializer=None,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary is not None:  # the replica push: each message checked as it arrives
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_client_stream(handler.stream_unary, handler.request_deserializer, check, short),
                request_deserializer=None,
                response_serializer=handler.response_serializer,
            )
        return handler  # bidirectional streams: none in our services

    def _decode(self, raw: bytes, deserialize: Callable[[bytes], Any], check: Validator | None,
                context: grpc.ServicerContext) -> Any:
        if len(raw) > self.max_request_bytes:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request of {len(raw)} bytes exceeds the {self.max_request_bytes}-byte limit")
        try:
            request = deserialize(raw)
        except (DecodeError, ValueError, TypeError):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed request: not a valid protobuf message")
        problem = check(request) if check is not None else None
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        return request

    def _observe(self, short: str, context: grpc.ServicerContext, failed: bool, seconds: float | None) -> None:
        if self._observer is None:
            return
        code = context.code() if hasattr(context, "code") else None
        if code is None:
            code = grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK
        self._observer(short, code.name, seconds)

    def _wrap_unary(self, behavior: Callable, deserialize: Callable, check: Validator | None, short: str) -> Callable:
        def guarded(raw: bytes, context: grpc.ServicerContext) -> Any:
            start = time.perf_counter()
            failed = True
            try:
                request = self._decode(raw, deserialize, check, context)
                response = behavior(request, context)
                failed = False
                return response
            finally:
                self._observe(short, context, failed, time.perf_counter() - start)

        return guarded

    def _wrap_client_stream(self, behavior: Callable, deserialize: Callable, check: Validator | None,
                            short: str) -> Callable:
        def guarded(raw_messages: Any, context: grpc.ServicerContext) -> Any:
            start = time.perf_counter()
            failed = True
            try:
                # Decoded lazily: a bad message aborts the call where the handler reads it, so whatever the
                # handler staged from the earlier ones is dropped by its own error path.
                requests = (self._decode(raw, deserialize, check, context) for raw in raw_messages)
                response = behavior(requests, context)
                failed = False
                return response
            finally:
                self._observe(short, context, failed, time.perf_counter() - start)

        return guarded

    def _wrap_stream(self, behavior: Callable, deserialize: Callable, check: Validator | None, short: str) -> Callable:
        def guarded(raw: bytes, context: grpc.ServicerContext) -> Any:
            failed = True
            acquired = remote = False
            try:
                request = self._decode(raw, deserialize, check, context)
                remote = self._max_remote > 0 and not str(context.peer()).startswith("unix:")
                if remote:
                    with self._remote_lock:
                        if self._remote >= self._max_remote:
                            remote = False  # not counted: nothing to give back
                            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                          f"too many concurrent streams from network peers ({self._max_remote}); "
                                          "retry later (the rest are kept for local launchers)")
                        self._remote += 1
                if self._streams is not None:
                    acquired = self._streams.acquire(blocking=False)
                    if not acquired:
                        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      "too many concurrent streams; retry later or raise grpc.max_watchers")
                yield from behavior(request, context)
                failed = False
            finally:
                if remote:
                    with self._remote_lock:
                        self._remote -= 1
                if acquired:
                    self._streams.release()
                self._observe(short, context, failed, None)

        return guarded


#: The standard health service every trainguard server exposes beside its own (unauthenticated, also on TCP).
HEALTH_SERVICE = "grpc.health.v1.Health"
#: Largest health request a server without a configured bound accepts: a HealthCheckRequest is a service name.
HEALTH_MAX_REQUEST_BYTES = 4096


class HealthGuard(grpc.ServerInterceptor):
    """The size and well-formedness checks of :class:`RequestGuard` on ``grpc.health.v1`` (Check, List, Watch).

    The health service answers anyone who reaches the port; gRPC's own deserializer answered random bytes there
    with INTERNAL and an ERROR traceback in the server's log per request. Watch keeps grpcio's non-blocking form:
    a plain generator wrapper held a serving thread per open stream, so a few idle watchers (probes) took every
    thread away from health checks. Other services pass untouched.
    """

    def __init__(self, max_request_bytes: int) -> None:
        """Creates the guard.

        Args:
            max_request_bytes: largest accepted request, in bytes.
        """
        self._guard = RequestGuard(HEALTH_SERVICE, max_request_bytes)

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        if details.method == f"/{HEALTH_SERVICE}/Watch":
            return self._watch(continuation(details))
        if details.method.startswith(f"/{HEALTH_SERVICE}/"):
            return self._guard.intercept_service(continuation, details)
        return continuation(details)

    def _watch(self, handler: Any) -> Any:
        if handler is None or handler.unary_stream is None:
            return handler
        behavior, deserialize = handler.unary_stream, handler.request_deserializer
        non_blocking = bool(getattr(behavior, "experimental_non_blocking", False))
        guard = self._guard

        def watch(raw: bytes, context: grpc.ServicerContext, send_response_callback: Callable | None = None) -> Any:
            request = guard._decode(raw, deserialize, None, context)
            if non_blocking:
                return behavior(request, context, send_response_callback)
            return behavior(request, context)

        watch.experimental_non_blocking = non_blocking  # type: ignore[attr-defined]
        return grpc.unary_stream_rpc_method_handler(watch, request_deserializer=None,
                                                    response_serializer=handler.response_serializer)
