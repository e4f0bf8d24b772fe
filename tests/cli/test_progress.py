"""Progress: phase, elapsed time and what is waited on; live on a TTY, plain lines otherwise."""

from __future__ import annotations

import io
import time

from patcher.cli.commands.common import Progress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_with_heartbeat_and_duration():
    out = io.StringIO()
    p = Progress(out, heartbeat=0.3, slow=0.2)
    p("installing torch")
    p.note("pip: Collecting torch==2.13.0+cpu\n")
    time.sleep(1.6)
    p("running the engine")
    p.close()
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text  # CI logs get plain lines
    lines = text.splitlines()
    assert lines[0] == "… installing torch"
    assert any(line.startswith("  … still installing torch (") and "waiting" not in line
               and "pip: Collecting torch==2.13.0+cpu" in line for line in lines)
    assert any(line.startswith("  installing torch: ") and line.endswith(" s") for line in lines)
    assert lines[-1] == "… running the engine"


def test_live_line_on_a_tty():
    out = Tty()
    p = Progress(out, slow=0.2)
    p("engine run")
    p.note("loading weights")
    time.sleep(0.8)
    p.close()
    text = out.getvalue()
    assert "\r\x1b[K… engine run (" in text and "loading weights" in text
    assert text.endswith("\r\x1b[K")  # the live line is cleared, never left half-drawn


def test_control_characters_in_phases_are_escaped():
    out = io.StringIO()
    p = Progress(out)
    p("file \x1b[31mred\nx")
    p.close()
    assert out.getvalue() == "… file \\x1b[31mred\\nx\n"
