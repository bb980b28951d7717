"""The relaunched job's output, copied to ours: the launcher's own chatter and its "BAD
TERMINATION" banner removed, generated text passed through as soon as it arrives."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable

# Lines that Hydra's mpiexec and its proxies print about their own teardown, e.g.
# "[mpiexec@host] Sending Ctrl-C to processes as requested" or
# "[proxy:0@host] HYD_pmcd_pmip_control_cmd_cb (…) assert (!closed) failed".
LAUNCHER_PREFIXES = (b"[mpiexec@", b"[proxy:")


class LauncherFilter:
    """Removes the launcher's own messages from a byte stream: from "[mpiexec@" or "[proxy:" to the
    end of that line, wherever it starts (Hydra writes into the same pipe as the ranks, so after a
    token streamed without newline its message may start mid-line). Such messages describe the
    launcher's side of a failure (a rank that died, the teardown after a stop), which pipeinfer
    reports itself in one line; the first few are kept in `dropped`, for that line. Everything else
    passes at once, except a tail that may be the start of a launcher message.
    """

    KEEP = 5  # launcher messages remembered for the report

    def __init__(self, prefixes: tuple[bytes, ...] = LAUNCHER_PREFIXES):
        self.prefixes = prefixes
        self.held = b""  # the end of the last chunk, which may begin a prefix
        self.dropping = False  # inside a launcher message, up to its newline
        self.dropped: list[bytes] = []  # the first KEEP launcher messages, whole lines

    def _tail_to_hold(self, data: bytes) -> int:
        """Length of the longest end of data that is a proper start of a prefix."""
        best = 0
        for p in self.prefixes:
            for k in range(min(len(p) - 1, len(data)), best, -1):
                if data.endswith(p[:k]):
                    best = k
                    break
        return best

    def feed(self, data: bytes) -> bytes:
        data, self.held = self.held + data, b""
        out: list[bytes] = []
        i = 0
        while i < len(data):
            if self.dropping:
                nl = data.find(b"\n", i)
                self._remember(data[i:len(data) if nl < 0 else nl])
                if nl < 0:
                    break
                self.dropping, i = False, nl + 1
                if len(self.dropped) <= self.KEEP:
                    self.dropped.append(b"")
                continue
            hits = [k for k in (data.find(p, i) for p in self.prefixes) if k >= 0]
            if hits:
                out.append(data[i:min(hits)])
                self.dropping, i = True, min(hits)
                continue
            keep = self._tail_to_hold(data[i:])
            out.append(data[i:len(data) - keep])
            self.held = data[len(data) - keep:]
            break
        return b"".join(out)

    def _remember(self, part: bytes) -> None:
        if not self.dropped:
            self.dropped.append(b"")
        if len(self.dropped) <= self.KEEP:
            self.dropped[-1] += part

    @property
    def messages(self) -> list[str]:
        return [m.decode(errors="replace").strip() for m in self.dropped if m.strip()]

    def close(self) -> bytes:
        held, self.held = self.held, b""
        return b"" if self.dropping else held


class BannerFilter:
    """Removes Hydra's "BAD TERMINATION" banner from a byte stream, passing everything else through
    as soon as it arrives (generated text streams without newlines, so it is not line-buffered).

    Hydra prints the banner on its stdout whenever it kills the remaining ranks of a failed job,
    which is how a failed job ends. Either the head already printed the error in one line, or
    relaunch() reports it in one line, so the banner is noise. Only the exact banner is removed: a
    rule of '=' followed by its title line, up to its closing "Please see the FAQ…" line. Blank
    lines and '=' rules are held back until the next line shows whether they open a banner.
    """

    _RULE_MIN = 20
    _LINE_START_KEPT = 64  # bytes of a line kept for error detection
    _TITLE = b"=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES"
    _LAST = b"Please see the FAQ page for debugging suggestions"
    _EXIT_STRING = b"YOUR APPLICATION TERMINATED WITH THE EXIT STRING: "
    _PID = re.compile(rb"^=\s+PID (\d+) RUNNING AT ")

    def __init__(self):
        self.partial = b""  # bytes of the current line not yet passed through
        self.held: list[bytes] = []  # complete lines held back (blank lines, then maybe one rule)
        self.in_banner = False
        self.line_start = True  # nothing of the current line was passed through yet
        self.exit_string: str | None = None  # Hydra's reason, e.g. "Killed (signal 9)"
        self.failed_pid: int | None = None  # the process Hydra saw fail ("PID 30425 RUNNING AT vm")
        self.lines: list[bytes] = []  # complete lines passed through (for error detection)
        # The start of a line passed through before its end arrived (a line can come in several
        # reads, under load): it joins `lines` when the line ends.
        self.open_line = b""

    @classmethod
    def _is_rule(cls, line: bytes) -> bool:
        return len(line) >= cls._RULE_MIN and line.strip(b"=") == b""

    def _holding_rule(self) -> bool:
        return bool(self.held) and self._is_rule(self.held[-1].rstrip(b"\r\n"))

    def _may_hold(self, part: bytes) -> bool:
        """Could this start of a line still be part of a banner?"""
        if self.in_banner:
            return True
        if self._holding_rule():
            return self._TITLE.startswith(part)
        return part.strip(b"=") == b""

    def _release(self, out: list[bytes]) -> None:
        out.extend(self.held)
        self.held.clear()

    def _line(self, raw: bytes, out: list[bytes]) -> None:
        """A complete line (with its newline) that starts at a line start."""
        line = raw.rstrip(b"\r\n")
        if self.in_banner:
            if line.startswith(self._EXIT_STRING):
                self.exit_string = line[len(self._EXIT_STRING):].decode(errors="replace")
            pid = self._PID.match(line)
            if pid is not None and self.failed_pid is None:
                self.failed_pid = int(pid[1])
            self.in_banner = line != self._LAST
            return
        if self._holding_rule() and line == self._TITLE:
            self.held.clear()  # the banner's rule and the blank lines before it
            self.in_banner = True
            return
        if line == b"" and not self._holding_rule():
            self.held.append(raw)
            return
        if self._is_rule(line):
            if self._holding_rule():
                out.append(self.held.pop())  # two rules in a row: the first is text
            self.held.append(raw)
            return
        self._release(out)
        out.append(raw)
        self.lines.append(line)

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        i = 0
        while i < len(data):
            nl = data.find(b"\n", i)
            if not self.line_start:  # inside a line already passed through
                end = len(data) if nl < 0 else nl + 1
                out.append(data[i:end])
                self.open_line = (self.open_line + data[i:end])[:self._LINE_START_KEPT]
                self.line_start = nl >= 0
                if self.line_start:
                    self.lines.append(self.open_line.rstrip(b"\r\n"))
                i = end
                continue
            if nl < 0:  # the rest is an incomplete line
                self.partial += data[i:]
                if not self._may_hold(self.partial):
                    self._release(out)
                    out.append(self.partial)
                    self.open_line = self.partial[:self._LINE_START_KEPT]
                    self.partial, self.line_start = b"", False
                break
            self._line(self.partial + data[i:nl + 1], out)
            self.partial = b""
            i = nl + 1
        return b"".join(out)

    def close(self) -> bytes:
        out: list[bytes] = []
        if not self.in_banner:
            self._release(out)
            out.append(self.partial)
        self.partial, self.in_banner = b"", False
        return b"".join(out)


class OutputPump(threading.Thread):
    """Copies one of the job's output streams to ours through a BannerFilter and a LauncherFilter;
    once the job is being stopped, with drop_when_stopping, it drops the rest of the stream.
    With debug set, everything passes."""

    def __init__(self, src, dst, debug: bool, on_broken: Callable[[], None], stopping: threading.Event,
                 drop_when_stopping: bool = False):
        super().__init__(daemon=True, name="mpiexec-output")
        self.src, self.dst, self.on_broken, self.stopping = src, dst, on_broken, stopping
        self.debug, self.drop_when_stopping = debug, drop_when_stopping
        self.filter = None if debug else BannerFilter()
        self.launcher_filter = LauncherFilter()
        self.reported = False  # a line starting with "Error: " went through
        self.passed = 0  # bytes of the job's own output that went through (it ran)
        self.broken = False  # our reader went away (`pipeinfer … | head`)
        self.start()

    @property
    def exit_string(self) -> str | None:
        return self.filter.exit_string if self.filter else None

    @property
    def failed_pid(self) -> int | None:
        return self.filter.failed_pid if self.filter else None

    def _stopping(self) -> bool:
        return self.stopping.is_set() and not self.debug

    def run(self) -> None:
        fd = self.src.fileno()
        while chunk := os.read(fd, 1 << 16):
            if self.filter is not None:
                chunk = self.filter.feed(chunk)
                self.reported = self.reported or any(l.startswith(b"Error: ") for l in self.filter.lines)
                self.filter.lines.clear()
            elif b"Error: " in chunk:
                self.reported = True
            self._out(chunk)
        if self.filter is not None:
            self._out(self.filter.close())
        if not self.debug and not (self._stopping() and self.drop_when_stopping):
            self._write(self.launcher_filter.close())

    def _out(self, data: bytes) -> None:
        if self.debug:
            self._write(data)
            return
        if self._stopping() and self.drop_when_stopping:
            return
        self._write(self.launcher_filter.feed(data))

    @property
    def launcher_messages(self) -> list[str]:
        return self.launcher_filter.messages

    def _write(self, data: bytes) -> None:
        self.passed += len(data)
        if not data or self.broken:
            return  # keep draining the job's output, so that mpiexec never blocks on a full pipe
        try:
            self.dst.write(data)
            self.dst.flush()
        except (BrokenPipeError, ValueError):
            # Like a command killed by SIGPIPE: stop the job, and leave quietly (writes to a
            # devnull from now on, so that Python's own flush at exit does not complain).
            self.broken = True
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.dst.fileno())
            os.close(devnull)
            self.on_broken()

