"""Character sets: MSH-18 / HL7 table 0211 to a Python codec, and strict decoding.

Which codec a message is decoded with (MSH-18, else the channel's
``encoding``), which names are refused and why (UTF-16/32: 102, anything
else unknown: 103), and the one strict decode of a message with its segment
ends normalised to ``\\r`` — what ``hl7.parse`` and the upstream ``body``
expect (docs/acks.md#character-sets). Intake decodes a message once, here;
the stored bytes stay exactly as received.
"""

from __future__ import annotations

import codecs
import encodings
import encodings.aliases
import re

from agent.errors import EnvelopeError, UnsupportedCharset

__all__ = [
    "CHARSETS_0211",
    "TEXT_CODECS",
    "decode_message",
    "resolve_codec",
    "sniff_wide_encoding",
    "text_codec",
]


# HL7 table 0211 (alternate character sets) and the aliases senders use, to
# Python codecs. Keys are normalised with _norm_charset(). UTF-16/32 map to
# None: HL7 forbids them with MLLP, whose framing bytes must be single bytes.
CHARSETS_0211: dict[str, str | None] = {
    "ASCII": "ascii",
    "8859/1": "iso8859-1",
    "8859/2": "iso8859-2",
    "8859/3": "iso8859-3",
    "8859/4": "iso8859-4",
    "8859/5": "iso8859-5",
    "8859/6": "iso8859-6",
    "8859/7": "iso8859-7",
    "8859/8": "iso8859-8",
    "8859/9": "iso8859-9",
    "8859/15": "iso8859-15",
    "UNICODE UTF-8": "utf-8",
    "UTF-8": "utf-8",
    "ISO IR6": "ascii",
    "ISO IR 6": "ascii",
    "ISO IR100": "iso8859-1",
    "ISO IR 100": "iso8859-1",
    "ISO IR192": "utf-8",
    "ISO IR 192": "utf-8",
    # ISO 2022 (7-bit, escape sequences; the MLLP framing bytes never occur).
    "ISO IR14": "iso2022_jp",
    "ISO IR87": "iso2022_jp",
    "ISO IR159": "iso2022_jp_2",
    "SJIS": "cp932",
    "GB 18030-2000": "gb18030",
    "KS X 1001": "euc_kr",  # KS X 1001 as sent over 8-bit links: EUC-KR
    "BIG-5": "big5",
    "UNICODE": None,
    "UNICODE UTF-16": None,
    "UNICODE UTF-32": None,
}

#: Python codecs of the same text encodings as table 0211 names, besides the
#: ones the table maps to: Shift_JIS itself (``SJIS`` maps to its superset cp932).
_SAME_ENCODINGS = ("shift_jis",)

_WS = re.compile(r"[\s_]+")
# A character set name as it can appear in MSH-18 or the channel ``encoding``:
# printable ASCII letters, digits and the punctuation table 0211 and Python
# codec names use. Anything else (a NUL, control bytes, 1 MB of junk) is no
# name, and never reaches Python's codec registry.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._/-]{0,63}")
# What an HL7/MLLP codec must encode byte-for-byte like ASCII: the framing and
# the default delimiters. Rejects UTF-16/32, UTF-7, EBCDIC and non-text codecs.
_STRUCTURE = "MSH|^~\\&#\r\n\x0b\x1c 0123456789AZaz"
_STRUCTURE_BYTES = _STRUCTURE.encode("ascii")


def _norm_charset(name: str) -> str:
    return _WS.sub(" ", name.strip()).upper()


def _py_key(name: str) -> str:
    """A Python codec name normalised like ``encodings.search_function`` does it."""
    return encodings.normalize_encoding(name).lower()


def _build_python_names() -> tuple[dict[str, str], frozenset[str]]:
    """Python names (and ``encodings.aliases``) of the accepted codecs, and of UTF-16/32.

    Built once from the targets of table 0211, so the hot path is a dict lookup
    and a sender's MSH-18 is never handed to ``codecs.lookup``, which accepts
    transforms (``idna``, ``rot13``, ``zlib``...) and raises ValueError on a NUL.
    """
    targets = {codec for codec in CHARSETS_0211.values() if codec} | set(_SAME_ENCODINGS)
    accepted: dict[str, str] = {}
    module_of: dict[str, str] = {}
    for target in targets:
        canonical = codecs.lookup(target).name
        if _STRUCTURE.encode(canonical) != _STRUCTURE_BYTES:  # pragma: no cover - table error
            raise AssertionError(f"{target} does not encode HL7 delimiters as ASCII")
        key = _py_key(target)
        module = encodings.aliases.aliases.get(key, key)
        module_of[module] = canonical
        for name in (key, _py_key(canonical), module):
            accepted[name] = canonical
    for alias, module in encodings.aliases.aliases.items():
        if module in module_of:
            accepted[alias] = module_of[module]
    wide_modules = {"utf_16", "utf_16_le", "utf_16_be", "utf_32", "utf_32_le", "utf_32_be"}
    wide = {alias for alias, module in encodings.aliases.aliases.items() if module in wide_modules}
    return accepted, frozenset(wide | wide_modules | {"utf_16le", "utf_16be", "utf_32le", "utf_32be"})


_PYTHON_NAMES, _WIDE_NAMES = _build_python_names()
#: The canonical Python codecs intake ever decodes with (and ACKs are encoded in).
TEXT_CODECS: frozenset[str] = frozenset(_PYTHON_NAMES.values())


def _quoted(name: str) -> str:
    """``name`` for a message: bounded and with control characters escaped (repr)."""
    return repr(name[:40] + ("..." if len(name) > 40 else ""))


#: text_codec's answers by name: every message and every ACK asks it, with the
#: few names a site's senders use. Bounded in count and name length (the
#: name comes from the sender's MSH-18): a flood of odd names is answered
#: uncached, as before.
_TEXT_CODEC_CACHE: dict[str, str | None] = {}
_TEXT_CODEC_CACHE_SIZE = 256


def text_codec(name: str) -> str | None:
    """The canonical Python codec of a table 0211 name or a Python name of one, else None.

    None for UTF-16/32 (forbidden with MLLP), for transforms and for anything
    that is no character set. Never raises.
    """
    try:
        return _TEXT_CODEC_CACHE[name]
    except KeyError:
        pass
    codec = _text_codec(name)
    if len(name) <= 64 and len(_TEXT_CODEC_CACHE) < _TEXT_CODEC_CACHE_SIZE:
        _TEXT_CODEC_CACHE[name] = codec
    return codec


def _text_codec(name: str) -> str | None:
    stripped = name.strip()
    if not _NAME.fullmatch(stripped):
        return None
    key = _norm_charset(stripped)
    if key in CHARSETS_0211:
        mapped = CHARSETS_0211[key]
        return None if mapped is None else _PYTHON_NAMES[_py_key(mapped)]
    py = _py_key(stripped)
    return _PYTHON_NAMES.get(py) or _PYTHON_NAMES.get(py.replace(".", "_"))


def _resolve_one(name: str) -> str:
    codec = text_codec(name)
    if codec is not None:
        return codec
    stripped = name.strip()
    wide = _NAME.fullmatch(stripped) is not None and (
        CHARSETS_0211.get(_norm_charset(stripped), "") is None or _py_key(stripped) in _WIDE_NAMES
    )
    if wide:
        raise UnsupportedCharset(
            f"character set {_quoted(stripped)} (UTF-16/UTF-32) is forbidden with MLLP", error_code=102
        )
    # HL7 table 0357: 103 table value not found (the value is no table 0211 character set).
    raise UnsupportedCharset(f"unknown character set {_quoted(stripped)}", error_code=103)


def resolve_codec(msh18: str, channel_encoding: str) -> str:
    """Python codec for a message: MSH-18 if set, else the channel's ``encoding``.

    Both take HL7 table 0211 names (``8859/1``, ``UNICODE UTF-8``) or Python
    names of those same text encodings (``latin-1``, ``utf8``); ``""`` for the
    channel means utf-8. Raises UnsupportedCharset: 102 for UTF-16/32 (HL7
    forbids them with MLLP), 103 for every other name, Python codecs that are
    transforms (``idna``, ``rot13``, ``base64``) or other character sets included.
    Never raises anything else, whatever the bytes of the name.
    """
    if msh18.strip():
        return _resolve_one(msh18)
    return _resolve_one(channel_encoding if channel_encoding.strip() else "utf-8")


#: A blank segment after the first: CR, whitespace or nothing, CR (``\s`` is what ``str.strip`` strips).
_BLANK_SEGMENT = re.compile(r"\r[^\S\r]*\r")


def decode_message(data: bytes, codec: str) -> str:
    """Decode strictly and normalise segment ends to ``\\r``: the upstream ``body`` (docs/protocol.md#transmit).

    ``\\r\\n`` and lone ``\\n`` become ``\\r``; blank lines are dropped; every
    segment ends in ``\\r``; leading blanks or a BOM before ``MSH`` are dropped
    (``read_msh`` tolerates them too). Undecodable bytes are the sender's data
    type error: EnvelopeError 102.
    """
    try:
        text = data.decode(codec)
    except UnicodeDecodeError as exc:
        raise EnvelopeError(
            f"bytes not valid {codec} at offset {exc.start}", error_code=102
        ) from None
    except LookupError:
        raise UnsupportedCharset(f"unknown character set {codec!r}", error_code=102) from None
    if text.startswith("MSH") and text.endswith("\r") and "\n" not in text and _BLANK_SEGMENT.search(text) is None:
        return text  # already normalised (what senders send): the steps below would return it unchanged
    text = text.lstrip("\ufeff\r\n \t")
    text = text.replace("\r\n", "\r").replace("\n", "\r")
    segments = [seg for seg in text.split("\r") if seg.strip()]
    if not segments:
        return ""
    return "\r".join(segments) + "\r"

# Byte patterns of a frame that starts "MSH" (or a BOM) in a wide encoding.
# HL7 forbids UTF-16/32 with MLLP; such a frame still gets a reject,
# not the silence owed to a frame with no MSH at all.
_WIDE_STARTS: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xfe\x00\x00", "utf-32"),
    (b"\x00\x00\xfe\xff", "utf-32"),
    (b"\xff\xfe", "utf-16"),
    (b"\xfe\xff", "utf-16"),
    (b"M\x00\x00\x00S\x00\x00\x00H\x00\x00\x00", "utf-32-le"),
    (b"\x00\x00\x00M\x00\x00\x00S\x00\x00\x00H", "utf-32-be"),
    (b"M\x00S\x00H\x00", "utf-16-le"),
    (b"\x00M\x00S\x00H", "utf-16-be"),
)


def sniff_wide_encoding(data: bytes) -> str | None:
    """The UTF-16/32 codec a frame is written in, when it starts with a BOM or a wide "MSH"."""
    head = data.lstrip(b"\r\n")[:16]
    for prefix, codec in _WIDE_STARTS:
        if head.startswith(prefix):
            return codec
    return None
