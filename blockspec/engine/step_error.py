"""A step that raised: which requests it failed, and whether the engine may go on."""

from __future__ import annotations

from blockspec.outputs import RequestOutput

# NOTE: CUDA reports a fault of the device context (an illegal address, a device-side assert)
# as a RuntimeError (torch >= 2.6: torch.AcceleratorError) whose message names it; after one,
# every later kernel fails too, so the process must end. An out-of-memory error is not one.
_FATAL_MARKERS = ("cuda error", "device-side assert", "illegal memory access", "cublas",
                  "cudnn", "nccl error", "accelerator", "parallel worker")


def is_fatal(error: BaseException) -> bool:
    """Whether the engine's device state can no longer be trusted after `error`."""
    if not isinstance(error, Exception):
        return True  # KeyboardInterrupt, SystemExit, ...
    name = type(error).__name__.lower()
    if "outofmemory" in name:
        return False
    text = f"{name}: {error}".lower()
    return any(m in text for m in _FATAL_MARKERS)


class StepError(RuntimeError):
    """Raised by LLMEngine.step when the step failed. Its requests are finished with
    finish_reason "error" (their KV blocks freed) and `outputs` holds their final outputs; the
    engine keeps serving the others unless `fatal`."""

    def __init__(self, cause: BaseException, outputs: list[RequestOutput]) -> None:
        super().__init__(f"the engine step failed: {type(cause).__name__}: {cause}")
        self.cause = cause
        self.outputs = outputs
        self.fatal = is_fatal(cause)
