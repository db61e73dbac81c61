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


def transmittable(text: str) -> str:
    """``text`` with lone surrogates escaped (``\\udcff``), everything else as it is.

    A name the kernel holds as bytes that are no UTF-8 (an interface, a process) reaches Python as
    :func:`os.fsdecode` makes it: each bad byte a lone surrogate. Such a string cannot be encoded as UTF-8, so a
    protobuf string field holding it raised ``UnicodeEncodeError`` at the first message that carried it (an event
    about that link, a status listing its metrics), and the report or status call failed instead of naming it.

    Args:
        text: any text; a non-string is converted with :func:`str` first.

    Returns:
        The text itself when it encodes as UTF-8 (the common case, no copy), else a copy with each surrogate
        escaped.
    """
    if not isinstance(text, str):
        text = str(text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "".join(_escape(ch) if "\ud800" <= ch <= "\udfff" else ch for ch in text)
    return text


__all__ = ["printable", "transmittable"]
