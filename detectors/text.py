"""Text from the outside world made safe to print: kernel log lines, device and process names, config strings.

Such text reaches terminals, logs and status lines. A control character (``ESC [2J`` clears a terminal, a newline
forges a second log line, a C1 ``CSI`` does both on some terminals) or a bidirectional override (U+202E turns
``exe.sh`` around) lets whoever names a process or a device rewrite what an operator reads. :func:`printable`
escapes every character :meth:`str.isprintable` refuses (categories Cc, Cf, Cs, Co, Cn, Zl, Zp and every space
but ' '), the way :func:`repr` writes them, and leaves the rest (letters of any script, backslashes, quotes) as
they are, so ordinary text is unchanged and a message stays one line.
"""

from __future__ import annotations

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    code = ord(ch)
    if ch in _NAMED:
        return _NAMED[ch]
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\x1b``, ``\\u202e``, ``\\n``).

    Args:
        text: any text; a non-string is converted with :func:`str` first.

    Returns:
        The text itself when all of it prints (the common case, no copy), else an escaped copy.
    """
    if not isinstance(text, str):
        text = str(text)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


__all__ = ["printable"]
