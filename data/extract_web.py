"""Extract plain text from Debian's sword-text-web (World English Bible, public domain).

Usage: python3 extract_web.py MODULE_DIR > corpus.txt
MODULE_DIR is usr/share/sword/modules/texts/ztext/engWEB2015eb from the .deb.
Reads the SWORD zText files directly (no libsword needed): *.bzs lists zlib
blocks, *.bzv lists verses (block, offset, size). Markup, footnotes, cross
references and Strong's numbers are dropped; the words are kept as they are.
"""
import re
import struct
import sys
import zlib


def verses(module_dir, testament):
    bzs = open(f"{module_dir}/{testament}.bzs", "rb").read()
    bzv = open(f"{module_dir}/{testament}.bzv", "rb").read()
    bzz = open(f"{module_dir}/{testament}.bzz", "rb").read()
    blocks = {}
    for i in range(len(bzv) // 10):
        block, offset, size = struct.unpack("<IIH", bzv[i * 10 : i * 10 + 10])
        if size == 0:
            continue
        if block not in blocks:
            off, csize, _ = struct.unpack("<III", bzs[block * 12 : block * 12 + 12])
            blocks[block] = zlib.decompress(bzz[off : off + csize])
        yield blocks[block][offset : offset + size].decode("utf-8")


def to_text(osis):
    # Front matter (a modern preface) and the glossary are not part of the books.
    s = re.sub(r'<div sID="(\w+)" type="(front|glossary)"/>.*?<div eID="\1" type="\2"/>', "", osis, flags=re.S)
    # A footnote sits between two words without a space 189 times: keep one.
    s = re.sub(r"<note\b.*?</note>", "<note/>", s, flags=re.S)
    s = s.replace("<note/><w ", " <w ").replace("<note/>", "")
    # A book title is split over several main titles: join them on one line.
    s = re.sub(r'</title>\s*<title [^>]*type="main"[^>]*>', " ", s)
    # Paragraph and stanza boundaries become blank lines, poetry lines newlines.
    s = re.sub(r'<div [^>]*type="(x-p|book|introduction)"[^>]*/>', "\n\n", s)
    s = re.sub(r"<lg\b[^>]*/>", "\n\n", s)
    s = re.sub(r"<l [^>]*eID=[^>]*/>", "\n", s)
    s = re.sub(r"<lb\b[^>]*/>", "\n", s)
    s = re.sub(r"<title\b[^>]*>(.*?)</title>", r"\n\n\1\n\n", s, flags=re.S)
    s = re.sub(r"<item\b[^>]*>", "\n", s)
    s = re.sub(r"<[^>]+>", "", s)
    return s


def main():
    module_dir = sys.argv[1]
    osis = " ".join(v for t in ("ot", "nt") for v in verses(module_dir, t))
    text = to_text(osis)
    lines = [re.sub(r"[ \t]+", " ", line).strip() for line in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"
    sys.stdout.write(text)


main()
