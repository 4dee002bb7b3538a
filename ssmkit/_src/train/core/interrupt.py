"""SIGINT and SIGTERM as requests to stop at the next step boundary."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
  """Set by the first SIGINT or SIGTERM that arrives while `stop_requests()` is active.

  Attributes:
    signal_name: "SIGINT" or "SIGTERM" once a signal arrived, else None.
  """

  def __init__(self):
    self.signal_name: str | None = None

  def __bool__(self) -> bool:
    return self.signal_name is not None


@contextlib.contextmanager
def stop_requests() -> Iterator[StopRequest]:
  """Catches SIGINT and SIGTERM in a `StopRequest` instead of stopping the process.

  The first signal sets the request and reinstates the previous handlers, so a second one acts
  as usual (KeyboardInterrupt, termination). The previous handlers are restored on exit. Outside
  the main thread, where Python cannot install handlers, the request is never set.

  Yields:
    The `StopRequest`, true once a signal arrived.
  """
  request = StopRequest()
  if threading.current_thread() is not threading.main_thread():
    yield request
    return
  previous = {signum: signal.getsignal(signum) for signum in _SIGNALS}

  def restore() -> None:
    for signum, handler in previous.items():
      signal.signal(signum, handler)

  def handle(signum: int, frame: object) -> None:
    del frame
    request.signal_name = signal.Signals(signum).name
    restore()

  for signum in _SIGNALS:
    signal.signal(signum, handle)
  try:
    yield request
  finally:
    restore()
