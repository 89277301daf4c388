"""The few CUDA driver calls the library makes itself, outside kernel launches (``_launch``):
asynchronous host-to-device copies, events, stream waits and the thread's capture mode, as
ctypes functions of ``libcuda`` (their argument conversions set once; no cuda-bindings object
a call). Each raises ``RuntimeError`` naming the call when the driver refuses it."""

import contextlib
import ctypes

from ._launch import _check_code

_FUNCTIONS = {}

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CU_EVENT_DISABLE_TIMING = 2
CU_STREAM_CAPTURE_MODE_RELAXED = 2

_P = ctypes.c_void_p
_U64 = ctypes.c_uint64
_UINT = ctypes.c_uint
_SIGNATURES = {
    "cuMemcpyHtoDAsync_v2": [_U64, _P, ctypes.c_size_t, _P],
    "cuEventCreate": [ctypes.POINTER(_P), _UINT],
    "cuEventRecord": [_P, _P],
    "cuEventQuery": [_P],
    "cuEventDestroy_v2": [_P],
    "cuStreamWaitEvent": [_P, _P, _UINT],
    "cuThreadExchangeStreamCaptureMode": [ctypes.POINTER(ctypes.c_int)],
    "cuStreamIsCapturing": [_P, ctypes.POINTER(ctypes.c_int)],
}


def _function(name):
    fn = _FUNCTIONS.get(name)
    if fn is None:
        fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
        fn.argtypes = _SIGNATURES[name]
        fn.restype = ctypes.c_int
        _FUNCTIONS[name] = fn
    return fn


def _call(name, *args):
    code = _function(name)(*args)
    if code:
        _check_code(code, name)


def copy_to_device_async(dst, src, nbytes, stream):
    """Copy ``nbytes`` from host address ``src`` (pinned memory: the copy then runs in stream
    order and the call returns at once) to device address ``dst`` on ``stream`` (a raw handle)."""
    _call("cuMemcpyHtoDAsync_v2", dst, src, nbytes, stream)


def new_event():
    """A new event without timing (the cheapest kind to record and wait for)."""
    event = _P()
    _call("cuEventCreate", ctypes.byref(event), CU_EVENT_DISABLE_TIMING)
    return event.value


def record_event(event, stream):
    _call("cuEventRecord", event, stream)


def event_done(event):
    """Whether the work ``event`` was last recorded after has completed (``cuEventQuery``)."""
    code = _function("cuEventQuery")(event)
    if code == CUDA_ERROR_NOT_READY:
        return False
    if code:
        _check_code(code, "cuEventQuery")
    return True


def destroy_event(event):
    _call("cuEventDestroy_v2", event)


def stream_wait_event(stream, event):
    """Work queued on ``stream`` from now on waits for ``event`` (on the device; the host goes
    on at once)."""
    _call("cuStreamWaitEvent", stream, event, 0)


def stream_capturing(stream):
    """Whether ``stream`` is being captured into a CUDA graph (``cuStreamIsCapturing``: active
    or invalidated)."""
    status = ctypes.c_int(0)
    _call("cuStreamIsCapturing", stream, ctypes.byref(status))
    return status.value != 0


@contextlib.contextmanager
def relaxed_capture_mode():
    """This thread's capture mode relaxed for the block: a stream capture (this thread's or, in
    the default global mode, any thread's) otherwise forbids calls such as ``cuEventQuery`` of
    an event recorded outside it, and invalidates the capture when one is made."""
    mode = ctypes.c_int(CU_STREAM_CAPTURE_MODE_RELAXED)
    _call("cuThreadExchangeStreamCaptureMode", ctypes.byref(mode))
    try:
        yield
    finally:
        _call("cuThreadExchangeStreamCaptureMode", ctypes.byref(mode))
