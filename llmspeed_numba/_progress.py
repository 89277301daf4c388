"""The progress bar of long work (compile-check, warm): one place, so every command looks alike."""

import time


class ProgressBar:
    """A text progress bar on a terminal (one line, redrawn); one line per item otherwise (logs,
    CI). ``start(name)`` before an item, ``done(name, ok)`` after it, ``close()`` at the end."""

    WIDTH = 30

    def __init__(self, total, stream):
        self.total, self.stream, self.count = total, stream, 0
        self.tty = stream.isatty()
        self.t0 = time.perf_counter()

    def _bar(self):
        filled = self.WIDTH * self.count // max(self.total, 1)
        return f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.count}/{self.total}"

    def start(self, name):
        self.t0 = time.perf_counter()
        if self.tty:
            self.stream.write(f"\r\033[K{self._bar()} compiling {name}")
            self.stream.flush()

    def done(self, name, ok):
        self.count += 1
        if not self.tty:
            status = "ok" if ok else "FAILED"
            width = len(str(self.total))
            self.stream.write(f"[{self.count:>{width}}/{self.total}] {name} {status} "
                              f"({time.perf_counter() - self.t0:.1f} s)\n")
        elif not ok:
            self.stream.write(f"\r\033[K{name} FAILED\n")
        self.stream.flush()

    def close(self):
        if self.tty:
            self.stream.write(f"\r\033[K{self._bar()}\n")
            self.stream.flush()
